"""`serve`: the server the user runs (mlx_lm.server by default, or `--server NAME`) with the bundles
mounted in its own prompt cache. This module only dispatches: the start-up every server shares is
pipeline.runtime.servers.startup, each server's differences its hook in pipeline.runtime.servers.
Errors are raised (PipelineError); the CLI (pipeline.cli.serve) parses options and prints.
"""

from __future__ import annotations

import argparse


def serve(args: argparse.Namespace, rest: list[str], argv: list[str]) -> int:
    """Run `args.server` (default mlx-lm) with its own options `rest`; `argv` is the whole
    command line (to re-execute it for huge pages)."""
    from pipeline.runtime import servers

    return servers.run(getattr(args, "server", None) or "mlx-lm", args, rest, argv)


__all__ = ["serve"]
