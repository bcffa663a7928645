"""`verify`: the full validator for deploy scripts, every byte hashed."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.common import err, read_template
from pipeline.format.errors import PipelineError


def add_parser(sub: argparse._SubParsersAction, parents: list) -> None:
    v = sub.add_parser(
        "verify",
        parents=parents,
        help="verify bundles against a model folder (exit 0 ok, 1 refused)",
    )
    v.add_argument("bundle", nargs="+", type=Path, help="bundle folders")
    v.add_argument("--model", type=Path, required=True, help="the model folder they are for")
    v.add_argument(
        "--chat-template",
        type=Path,
        help="template file the server will use instead of the model's",
    )
    v.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.runtime import verify

    template = read_template(args.chat_template)
    failed = 0
    for bundle in args.bundle:
        try:
            m = verify(bundle, args.model, template)
            print(f"ok {bundle} ({m.prefix.name}@{m.prefix.version}, {m.tokens.count} tokens)")
        except PipelineError as exc:
            err(str(exc))
            failed += 1
    return 1 if failed else 0
