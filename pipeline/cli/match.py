"""`match`: which bundle a request would reuse, how many tokens, and why not when none."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline.cli.common import err
from pipeline.format.errors import PipelineError
from pipeline.runtime.servers.tokens import SERVER_NAMES


def add_parser(sub: argparse._SubParsersAction, parents: list) -> None:
    m = sub.add_parser(
        "match", parents=parents, help="which bundle a chat request would reuse, and why not"
    )
    m.add_argument("--model", type=Path, required=True, help="the served model folder")
    source = m.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--prompt-file", type=Path, help="a chat request body (JSON with messages, optional tools)"
    )
    source.add_argument("--messages", help="the request's messages as a JSON list")
    m.add_argument(
        "--server",
        choices=SERVER_NAMES,
        default="mlx-lm",
        help="tokenize the request as this server does (default: mlx-lm, i.e. mlx_lm.server)",
    )
    m.set_defaults(func=run)


def _request(args: argparse.Namespace) -> tuple[list[dict], list[dict] | None]:
    from pipeline.builder.request import parse_request
    from pipeline.format.regular_files import FileProblem, read_text

    try:
        raw = read_text(args.prompt_file, 64 << 20) if args.prompt_file else args.messages
        body = json.loads(raw)
    except FileProblem as exc:
        raise PipelineError(f"--prompt-file {args.prompt_file}: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise PipelineError(f"the request is not valid JSON ({exc})") from None
    where = f"--prompt-file {args.prompt_file}" if args.prompt_file else "--messages"
    return parse_request(body, where)


def run(args: argparse.Namespace) -> int:
    from pipeline.builder.authoring import match_request
    from pipeline.format.errors import BundleError
    from pipeline.format.validate import validate
    from pipeline.runtime.mount import choose_versions, find_bundles, identity_for

    messages, tools = _request(args)
    identity = identity_for(args.model)
    paths, problems = find_bundles(args.bundles)
    for problem in problems:  # what serve would not mount either
        err(f"bundle {problem.path}: {problem.reason} (not considered)")
    valid = []
    for path in choose_versions(args.bundles, paths)[0]:
        try:
            valid.append(validate(path, identity))
        except BundleError as exc:
            err(f"{exc} (not considered)")
    request, matches = match_request(args.model, valid, messages, tools, args.server)
    as_server = "" if args.server == "mlx-lm" else f" ({args.server})"
    print(f"request: {len(request)} tokens{as_server}")
    for m in matches:
        verdict = f"reuses {m.reused_tokens} of its {m.bundle_tokens} tokens"
        why = f"; parts {m.divergence}" if m.divergence else ""
        print(f"  {m.name:<24} {verdict}{why}  {m.bundle}")
    if not matches or matches[0].reused_tokens == 0:
        print(
            "no bundle would be reused"
            + ("" if matches else f" (no valid bundle in {args.bundles})")
        )
        return 1
    return 0
