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
    v.add_argument(
        "bundle",
        nargs="*",
        type=Path,
        help="bundle folders (default: every bundle in <model>/prefix-bundles)",
    )
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
    bundles, failed = (args.bundle, 0) if args.bundle else _next_to_model(args.model)
    for bundle in bundles:
        try:
            m = verify(bundle, args.model, template)
            print(f"ok {bundle} ({m.prefix.name}@{m.prefix.version}, {m.tokens.count} tokens)")
        except PipelineError as exc:
            err(str(exc))
            failed += 1
    return 1 if failed else 0


def _next_to_model(model: Path) -> tuple[list[Path], int]:
    """No bundle arguments: every bundle in <model>/prefix-bundles, newest and older versions.

    stderr says which are the newest (what serve mounts); a symlink serve would not follow is
    refused (counted in the int returned). None found is an error.
    """
    import sys

    from pipeline.runtime import model_bundles, model_bundles_dir

    folder = model_bundles_dir(model)
    fix = f"pass bundle folders, or copy bundles there (python build.py pull --model {model} ...)"
    if not folder.is_dir():
        raise PipelineError(f"no bundle arguments and no {folder}; {fix}")
    newest, older, problems = model_bundles(model)
    for problem in problems:
        err(f"bundle {problem.path}: {problem.reason}")
    if not (newest or older or problems):
        raise PipelineError(f"no bundle in {folder}; {fix}")
    for path in sorted(newest + older):
        print(f"{'newest' if path in newest else 'older '} {path}", file=sys.stderr)
    return sorted(newest + older), len(problems)
