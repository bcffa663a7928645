"""One hook module per MLX server: `serve --server NAME` mounts bundles into that server's own
prompt cache, then runs the server's own command line.

mlx-lm (mlx_lm.server) is pipeline.runtime.serve; the others are modules here, imported only
when named (each imports its server, which this package never does at import time).
"""

from __future__ import annotations

import argparse
import importlib

from pipeline.runtime.servers.tokens import SERVER_NAMES

HOOKS = {
    "vllm-mlx": "pipeline.runtime.servers.vllm_mlx",
    "mlx-omni-server": "pipeline.runtime.servers.mlx_omni",
    "mlx-openai-server": "pipeline.runtime.servers.mlx_openai",
    "rapid-mlx": "pipeline.runtime.servers.rapid_mlx",
}
SERVE_NAMES = ("mlx-lm", *HOOKS)  # what `serve --server` takes

__all__ = ["HOOKS", "SERVER_NAMES", "SERVE_NAMES", "run"]


def run(server: str, args: argparse.Namespace, rest: list[str], argv: list[str]) -> int:
    """Mount and run `server` (one of HOOKS) with its own options `rest`."""
    return importlib.import_module(HOOKS[server]).run(args, rest, argv)
