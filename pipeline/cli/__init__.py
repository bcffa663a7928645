"""Command line: argparse, printing and exit codes. The only package that talks to the terminal.

One module per command, each with `add_parser(sub, parents)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from pathlib import Path

from pipeline.blas import ensure_fast_blas
from pipeline.cli.common import err
from pipeline.format.errors import PipelineError

__all__ = ["main", "parse_args", "setup_arg_parser"]

# Imported when the parser is built, after main has loaded OpenBLAS: some import mlx.
COMMANDS = (
    "build",
    "verify",
    "inspect",
    "listing",
    "prune",
    "new",
    "match",
    "push",
    "pull",
    "schema",
    "demo",
    "serve",
    "keygen",
    "sign",
)
DEFAULT_PREFIXES = Path("prefixes")
# `pull` and `serve` put or look for bundles in <model>/prefix-bundles unless --bundles is given.
DEFAULT_BUNDLES = Path("bundles")


def global_options(suppress: bool) -> argparse.ArgumentParser:
    """--prefixes/--bundles, accepted before and after the command (defaults set once, up front)."""
    p = argparse.ArgumentParser(add_help=False)
    # Subcommands must not reset a value given before the command: their copy has no default.
    default = argparse.SUPPRESS if suppress else None
    p.add_argument(
        "--prefixes", type=Path, default=default, help="definitions folder (default: prefixes)"
    )
    p.add_argument(
        "--bundles",
        type=Path,
        default=default,
        help="bundles folder (default: bundles; for pull and serve: <model>/prefix-bundles)",
    )
    return p


def setup_arg_parser() -> argparse.ArgumentParser:
    """The whole command line; argparse names the program as invoked (build.py, prefix-bundles)."""
    p = argparse.ArgumentParser(
        description="Build, verify and serve MLX prefix-cache bundles.",
        parents=[global_options(suppress=False)],
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        command = importlib.import_module(f"pipeline.cli.{name}")
        command.add_parser(sub, [global_options(suppress=True)])
    return p


@functools.cache
def _parser(argv0: str) -> argparse.ArgumentParser:
    # built once per program name: ~500 arguments cost 0.1-0.2 s (argparse looks up translations)
    return setup_arg_parser()


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse argv; only a command that passes options through (serve) may leave some unparsed."""
    parser = _parser(sys.argv[0])
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "passes_through", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.passthrough, args.argv = rest, argv
    args.prefixes = args.prefixes or DEFAULT_PREFIXES
    if args.bundles is None and not getattr(args, "bundles_near_model", False):
        args.bundles = DEFAULT_BUNDLES
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point: one-line 'error: ...' and exit 1 on failure, 2 on usage errors."""
    argv = sys.argv[1:] if argv is None else list(argv)
    ensure_fast_blas(argv)  # before any command module imports mlx; may re-execute this process
    args = parse_args(argv)
    try:
        return args.func(args)
    except PipelineError as exc:
        err(str(exc))
        return 1
    except OSError as exc:  # a last line of defence: every OS error is one line, never a traceback
        err(f"{exc.filename or 'I/O'}: {exc.strerror or exc}")
        return 1
    except KeyboardInterrupt:
        err("interrupted; no partial bundle was left in place")
        return 130


if __name__ == "__main__":
    sys.exit(main())
