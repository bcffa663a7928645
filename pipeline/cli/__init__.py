"""Command line: argparse, printing and exit codes. The only package that talks to the terminal.

One module per command, each with `add_parser(sub, parents)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib
import signal
import sys
from pathlib import Path

from pipeline import __version__
from pipeline.blas import ensure_fast_blas
from pipeline.cli.common import err, note
from pipeline.cli.parser import CliParser, given_options
from pipeline.format.errors import PipelineError, UsageError
from pipeline.format.manifest import FORMAT_VERSION, READ_VERSIONS

READ_TEXT = ", ".join(map(str, READ_VERSIONS))

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
    "server_env",
)
DEFAULT_PREFIXES = Path("prefixes")
# `pull` and `serve` put or look for bundles in <model>/prefix-bundles unless --bundles is given.
DEFAULT_BUNDLES = Path("bundles")


BOTH, BUNDLES, PREFIXES, NONE = {"prefixes", "bundles"}, {"bundles"}, {"prefixes"}, set()
# which global options each command reads: any other given is refused, and its help omits them
USES_GLOBALS = {
    "build": BOTH, "verify": BUNDLES, "inspect": NONE, "list": BOTH, "prune": BOTH,
    "new": PREFIXES, "match": BUNDLES, "push": NONE, "pull": BUNDLES, "schema": NONE,
    "demo": BOTH, "demo-model": NONE, "serve": BUNDLES, "keygen": NONE, "sign": NONE,
    "server-env": NONE,
}  # fmt: skip
MODULE_COMMANDS = {
    "listing": ("list",), "demo": ("demo", "demo-model"), "server_env": ("server-env",)
}  # fmt: skip


def global_options(suppress: bool, only: set[str] = BOTH) -> argparse.ArgumentParser:
    """--prefixes/--bundles, accepted before and after the command (defaults set once, up front)."""
    p = CliParser(add_help=False)
    # Subcommands must not reset a value given before the command: their copy has no default.
    default = argparse.SUPPRESS if suppress else None
    if "prefixes" in only:
        p.add_argument(
            "--prefixes", type=Path, default=default, help="definitions folder (default: prefixes)"
        )
    if "bundles" in only:
        p.add_argument(
            "--bundles",
            type=Path,
            default=default,
            help="bundles folder (default: bundles; for verify, match, pull and serve: "
            "<model>/prefix-bundles)",
        )
    return p


def setup_arg_parser() -> argparse.ArgumentParser:
    """The whole command line; argparse names the program as invoked (build.py, prefix-bundles)."""
    p = CliParser(
        description="Build, verify and serve MLX prefix-cache bundles.",
        parents=[global_options(suppress=False)],
    )
    p.add_argument(
        "-V",
        "--version",
        action="version",
        version=f"%(prog)s {__version__} (bundle format {FORMAT_VERSION}; reads {READ_TEXT})",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        command = importlib.import_module(f"pipeline.cli.{name}")
        uses = set().union(*(USES_GLOBALS[c] for c in MODULE_COMMANDS.get(name, (name,))))
        command.add_parser(sub, [global_options(suppress=True, only=uses)])
    return p


@functools.cache
def _parser(argv0: str) -> argparse.ArgumentParser:
    # built once per program name: ~500 arguments cost 0.1-0.2 s (argparse looks up translations)
    return setup_arg_parser()


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _spelled_out(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`help [COMMAND]` and `version` as the options they mean; an unknown command is a usage
    error with the nearest command named (`biuld`: did you mean 'build'?)."""
    word = _command_of(argv)
    if word is None or word in USES_GLOBALS:
        return argv
    at = argv.index(word)
    if word == "help":
        return [*argv[at + 1 : at + 2], "--help"]
    if word == "version":
        return ["--version"]
    close = difflib.get_close_matches(word, list(USES_GLOBALS), n=1)
    guess = f"; did you mean '{close[0]}'?" if close else ""
    parser.error(f"unknown command {word!r}{guess} (commands: {', '.join(USES_GLOBALS)})")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse argv; only a command that passes options through (serve) may leave some unparsed."""
    parser = _parser(sys.argv[0])
    argv = _spelled_out(parser, argv)
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "passes_through", False):
        command = _subparser(parser, args.command)
        for option in ("--prefixes", "--bundles"):
            if any(r == option or r.startswith(option + "=") for r in rest):
                command.error(f"{option} does not apply to {args.command}; leave it out")
        command.error(f"unrecognized arguments: {' '.join(rest)}")
    args.passthrough, args.argv = rest, argv
    for option in ("prefixes", "bundles"):
        if getattr(args, option, None) is not None and option not in USES_GLOBALS[args.command]:
            _subparser(parser, args.command).error(
                f"--{option} does not apply to {args.command}; leave it out"
            )
    _refuse_outside_form(_subparser(parser, args.command), args)
    args.prefixes = args.prefixes or DEFAULT_PREFIXES
    near_model = getattr(args, "bundles_near_model", False)
    if args.bundles is None and not near_model:
        args.bundles = DEFAULT_BUNDLES
    elif args.bundles is None and near_model == "read" and getattr(args, "model", None):
        from pipeline.runtime.mount import reading_bundles_dir

        args.bundles, said = reading_bundles_dir(args.model)  # one decision for every reader
        if said is not None and not getattr(args, "bundle", None):  # verify's own folders
            note(said)
    return args


def _refuse_outside_form(command: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A command's other form takes only its own options (`prune --snapshots DIR` takes only
    --apply), and an option that says how to do what another turns off (`build --full
    --parent-check`) is refused with it: any other given is a usage error, never silently
    ignored."""
    given = given_options(args)
    for form, options in getattr(args, "form_options", {}).items():
        others = [o for dest, o in given.items() if dest not in {form, *options}]
        if form in given and others:
            command.error(
                f"{others[0]} does not apply to {args.command} {given[form]}; leave it out"
            )
    for dest, moot in getattr(args, "moot_with", {}).items():
        given_moot = [given[m] for m in moot if m in given]
        if dest in given and given_moot:
            command.error(f"{given_moot[0]} does not apply with {given[dest]}; leave it out")


def _command_of(argv: list[str]) -> str | None:
    """The command argv names, read without the parser (before any import or re-exec)."""
    words = iter(argv)
    for word in words:
        if word in ("--prefixes", "--bundles"):
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point: one-line 'error: ...' and exit 1 on failure, 2 on usage errors."""
    own_process = argv is None  # the process's own command line: it may end the process itself
    argv = sys.argv[1:] if argv is None else list(argv)
    if _command_of(argv) == "serve" and hasattr(signal, "SIGHUP"):
        # a deploy's reload before serve can take it must not kill it (SIGHUP's default): the
        # mount ahead reads the folder anyway; serve notes one from its first step on
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # also across a re-exec (BLAS, huge pages)
    ensure_fast_blas(argv)  # before any command module imports mlx; may re-execute this process
    args = parse_args(argv)
    args.own_process = own_process
    try:
        return args.func(args)
    except UsageError as exc:  # one place decides: a usage error exits 2, whoever found it
        err(str(exc))
        return 2
    except PipelineError as exc:
        err(str(exc))
        return 1
    except OSError as exc:  # a last line of defence: every OS error is one line, never a traceback
        err(f"{exc.filename or 'I/O'}: {exc.strerror or exc}")
        return 1
    except KeyboardInterrupt:
        said = (
            "the server stopped"
            if args.command == "serve"
            else "no partial bundle was left in place"
        )
        err(f"interrupted; {said}")
        return 130


if __name__ == "__main__":
    sys.exit(main())
