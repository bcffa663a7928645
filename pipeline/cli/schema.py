"""`schema`: the JSON Schema of each command's `--json` document (committed in docs/schemas/)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline.cli.common import say
from pipeline.cli.reports import DOCUMENTS, schema_of, schema_text
from pipeline.format.errors import PipelineError


def add_parser(sub: argparse._SubParsersAction, parents: list) -> None:
    s = sub.add_parser(
        "schema",
        parents=parents,
        help="print the JSON Schema of a command's --json document",
        description="Print the JSON Schema (draft 2020-12) of the --json document of COMMAND, or "
        "of every command as one object keyed by command name.",
    )
    s.add_argument(
        "document",
        nargs="?",
        choices=sorted(DOCUMENTS),
        metavar="COMMAND",
        help=f"one of {', '.join(sorted(DOCUMENTS))} (default: all)",
    )
    s.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="write DIR/<command>.json for each (or the named) command instead of printing",
    )
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    names = [args.document] if args.document else sorted(DOCUMENTS)
    if args.out is not None:
        _write(args.out, names)
    elif args.document:
        print(schema_text(args.document), end="")
    else:
        print(json.dumps({name: schema_of(name) for name in names}, indent=2, sort_keys=True))
    return 0


def _write(folder: Path, names: list[str]) -> None:
    """DIR/<command>.json for each name, DIR made when missing; an OS error is one line."""
    fix = "name a folder this user can write (it is made when missing)"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name in names:
            path = folder / f"{name}.json"
            path.write_text(schema_text(name))
            say(str(path))
    except FileExistsError:
        raise PipelineError(f"schema --out {folder}: it is a file, not a folder; {fix}") from None
    except OSError as exc:
        where = exc.filename or folder
        raise PipelineError(
            f"schema --out {folder}: cannot write {where} ({exc.strerror or exc}); {fix}"
        ) from None
