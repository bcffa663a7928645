"""One hook module per MLX server: `serve --server NAME` mounts bundles into that server's own
prompt cache, then runs the server's own command line.

The names are the format's (pipeline.format.manifest.SERVER_NAMES: what a manifest records); this
registry maps each to its hook, imported only when named (a hook imports its server, which this
package never does at import time). A hook declares what its server differs by: `ADDRESS` (where
it binds by default) and `run(args, rest, argv)`, which calls the shared start-up
(pipeline.runtime.servers.startup) and installs its cache subclass. Adding a server: one module
here, one line in HOOKS, its name in the format's SERVER_NAMES (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import importlib

from pipeline.format.manifest import SERVER_NAMES
from pipeline.runtime.servers.options import check_admin, check_port

HOOKS = {
    "mlx-lm": "pipeline.runtime.servers.mlx_lm",
    "vllm-mlx": "pipeline.runtime.servers.vllm_mlx",
    "rapid-mlx": "pipeline.runtime.servers.rapid_mlx",
    "mlx-omni-server": "pipeline.runtime.servers.mlx_omni",
    "mlx-openai-server": "pipeline.runtime.servers.mlx_openai",
}
assert tuple(HOOKS) == SERVER_NAMES, "every server the format names has exactly one hook"
SERVE_NAMES = SERVER_NAMES  # what `serve --server` takes

__all__ = ["HOOKS", "SERVE_NAMES", "run"]


def run(server: str, args: argparse.Namespace, rest: list[str], argv: list[str]) -> int:
    """Check the options every server shares (its address, the admin endpoint) before anything
    is loaded, then run `server`'s hook with its own options `rest`."""
    hook = importlib.import_module(HOOKS[server])
    check_port(hook.ADDRESS, rest)
    check_admin(args)
    return hook.run(args, rest, argv)
