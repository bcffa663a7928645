"""`serve`: the server the user runs (mlx_lm.server by default, or `--server NAME`) with the bundles
mounted in its own prompt cache. This module only dispatches: the start-up every server shares is
pipeline.runtime.servers.startup, each server's differences its hook in pipeline.runtime.servers.
Errors are raised (PipelineError); the CLI (pipeline.cli.serve) parses options and prints.
"""

from __future__ import annotations

import argparse


def serve(args: argparse.Namespace, rest: list[str], argv: list[str]) -> int:
    """Run `args.server` (default: the registry's first) with its own options `rest`, read once
    into its options, through the one start-up sequence; `argv` is the whole command line (to
    re-execute it for huge pages)."""
    from pipeline.runtime.servers.options import ServeOptions
    from pipeline.runtime.servers.registry import hook_for, names
    from pipeline.runtime.servers.startup import serve as start

    hook = hook_for(getattr(args, "server", None) or names()[0])
    return start(hook, ServeOptions.from_args(args, rest, argv, hook))


__all__ = ["serve"]
