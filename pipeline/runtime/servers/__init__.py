"""One hook per MLX server: `serve --server NAME` mounts bundles into that server's own prompt
cache, then runs the server's own command line.

The names are the format's (pipeline.format.manifest.SERVER_NAMES: what a manifest records); this
registry maps each to its hook module, imported only when named (a hook imports its server only
when serve runs it). A hook module defines `Hook`, a pipeline.runtime.servers.hook.ServerHook
declaring what its server differs by; pipeline.runtime.servers.startup.serve runs the one
start-up sequence with it. Adding a server: one module here, one line in HOOKS, its name in the
format's SERVER_NAMES (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from pipeline.format.manifest import SERVER_NAMES

HOOKS = {
    "mlx-lm": "pipeline.runtime.servers.mlx_lm",
    "vllm-mlx": "pipeline.runtime.servers.vllm_mlx",
    "rapid-mlx": "pipeline.runtime.servers.rapid_mlx",
    "mlx-omni-server": "pipeline.runtime.servers.mlx_omni",
    "mlx-openai-server": "pipeline.runtime.servers.mlx_openai",
}
assert tuple(HOOKS) == SERVER_NAMES, "every server the format names has exactly one hook"
SERVE_NAMES = SERVER_NAMES  # what `serve --server` takes

__all__ = ["HOOKS", "SERVE_NAMES", "hook_for", "run"]


def hook_for(server: str) -> Any:
    """The hook (a ServerHook) of a server the format names."""
    return importlib.import_module(HOOKS[server]).Hook()


def run(server: str, args: argparse.Namespace, rest: list[str], argv: list[str]) -> int:
    """serve's command line read once into its options, then the one start-up sequence with
    `server`'s hook."""
    from pipeline.runtime.servers.options import ServeOptions
    from pipeline.runtime.servers.startup import serve

    hook = hook_for(server)
    return serve(hook, ServeOptions.from_args(args, rest, argv, hook.warm_up))
