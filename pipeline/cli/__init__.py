"""Command line: argparse, printing and exit codes. The only package that talks to the terminal.

One module per command, each with `add_parser(sub, parents)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.cli import (
    build,
    demo,
    inspect,
    listing,
    match,
    new,
    prune,
    pull,
    push,
    schema,
    verify,
)
from pipeline.cli.common import err
from pipeline.format.errors import PipelineError

COMMANDS = (build, verify, inspect, listing, prune, new, match, push, pull, schema, demo)
# The global --bundles default, compared by identity: `pull` puts bundles in <model>/prefix-bundles
# unless --bundles is given.
DEFAULT_BUNDLES = Path("bundles")


def global_options(suppress: bool) -> argparse.ArgumentParser:
    """--prefixes/--bundles, accepted before and after the command (defaults set once, up front)."""
    p = argparse.ArgumentParser(add_help=False)
    default = argparse.SUPPRESS if suppress else None
    p.add_argument(
        "--prefixes",
        type=Path,
        default=default or Path("prefixes"),
        help="definitions folder (default: prefixes)",
    )
    p.add_argument(
        "--bundles",
        type=Path,
        default=default or DEFAULT_BUNDLES,
        help="bundles folder (default: bundles)",
    )
    return p


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="build.py",
        description="Build, verify and serve MLX prefix-cache bundles.",
        parents=[global_options(suppress=False)],
        epilog="serve --model DIR --bundles DIR [mlx_lm.server options]: mlx_lm.server with "
        "bundles mounted (python build.py serve --help)",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub, [global_options(suppress=True)])
    sub.add_parser("serve", help="mlx_lm.server with bundles mounted (serve --help for options)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point: one-line 'error: ...' and exit 1 on failure, 2 on usage errors."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        from pipeline.runtime.serve import main as serve_main

        return serve_main(argv[1:])
    args = setup_arg_parser().parse_args(argv)
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
