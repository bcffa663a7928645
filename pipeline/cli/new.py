"""`new`: a first definition for a model, its template pinned, and its size in tokens."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.common import (
    add_json_option,
    emit_json,
    load_definitions,
    note,
    request_code_server,
    say,
    warn,
)
from pipeline.cli.parser import given_options


def add_parser(sub: argparse._SubParsersAction, parents: list) -> None:
    n = sub.add_parser(
        "new", parents=parents, help="write prefixes/NAME.toml for a model, template pinned"
    )
    n.add_argument("name", help="the prefix name (also the file name)")
    n.add_argument("--model", type=Path, required=True, help="the model folder it is built for")
    n.add_argument("--system-file", type=Path, help="the system prompt (default: a starter text)")
    n.add_argument("--tools", type=Path, help="OpenAI function tools, a JSON list")
    n.add_argument(
        "--from-request",
        type=Path,
        metavar="FILE",
        help="a request body (OpenAI chat completions or Anthropic messages, auto-detected): its "
        "system part and tools become the prefix",
    )
    n.add_argument(
        "--server",
        action="append",
        type=request_code_server,
        metavar="SERVER",
        default=[],
        help="with --from-request: a server whose own request code gives the ids (repeatable; "
        "Anthropic requests: vllm-mlx by default)",
    )
    n.add_argument(
        "--prefix-messages",
        type=_zero_or_more,
        default=0,
        metavar="N",
        help="with --from-request: also the first N messages after the system part",
    )
    add_json_option(n, "new")
    n.set_defaults(func=run)


def _zero_or_more(text: str) -> int:
    """argparse type of --prefix-messages: a count, never a negative (Python's from-the-end) slice."""
    try:
        number = int(text)
    except ValueError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give 0 or more messages, e.g. --prefix-messages 2"
        )
    return number


def run(args: argparse.Namespace) -> int:
    from pipeline.builder.authoring import definition_from_request, new_definition
    from pipeline.builder.prefill import encode
    from pipeline.builder.render import render_prefix
    from pipeline.format.errors import PipelineError

    if args.from_request is not None:
        if args.system_file or args.tools:
            raise PipelineError(
                "--from-request: the request gives the system text and tools; "
                "drop --system-file and --tools"
            )
        made = definition_from_request(
            args.prefixes,
            args.name,
            args.model,
            args.from_request,
            args.server,
            args.prefix_messages,
        )
        path, notes = made.path, made.notes
        for message in notes:
            note(message)
    elif args.server or "prefix_messages" in given_options(args):  # even --prefix-messages 0
        raise PipelineError("--server and --prefix-messages go with --from-request")
    else:
        path = new_definition(args.prefixes, args.name, args.model, args.system_file, args.tools)
        notes = []
    (definition,) = load_definitions(args.prefixes, [args.name])
    from pipeline.builder.model_files import load_tokenizer

    tokenizer = load_tokenizer(Path(args.model))
    rendered = render_prefix(definition, args.model)
    tokens = encode(tokenizer, rendered.text)
    follows = ", ".join(definition.spec.servers)
    how = f"; the build takes its ids from {follows}'s own request code" if follows else ""
    missing = _unbuildable(definition)
    refused = missing or _refused(definition, Path(args.model), rendered, tokenizer)
    why_not = missing or refused
    if args.json:
        from pipeline.cli.reports import NewReport

        emit_json(
            NewReport(
                name=args.name, path=str(path), model=str(args.model), api=definition.spec.api,
                servers=list(definition.spec.servers), tokens=len(tokens), notes=list(notes),
                buildable=why_not,
            )
        )  # fmt: skip
    else:
        where = "" if args.prefixes == Path("prefixes") else f" --prefixes {args.prefixes}"
        then = (
            f"; build it with 'prefix-bundles build {args.name}{where}'" if why_not is None else ""
        )
        say(
            f"wrote {path} ({len(tokens):,} tokens for {args.model} as the pinned template "
            f"renders it{how}){then}"
        )
    if missing is not None:
        warn(f"this environment cannot build it yet: {missing}")
    elif refused is not None:
        warn(f"build would refuse it as it is: {refused}")
    return 0


def _refused(definition, model: Path, rendered, tokenizer) -> str | None:
    """Why `build` would refuse the definition before any prefill (a turn the template drops, too
    few stable tokens), asked of the builder's own checks; None when they pass."""
    from pipeline.builder.builder import stable_cut
    from pipeline.builder.render import check_rendered
    from pipeline.format.errors import PipelineError

    try:
        check_rendered(definition, rendered.text)
        stable_cut(definition, model, rendered, tokenizer)
    except PipelineError as exc:
        return str(exc)
    return None


def _unbuildable(definition) -> str | None:
    """Why this environment cannot build the definition just written (a server whose request
    code gives the ids is not installed here), or None."""
    from pipeline.builder.server_ids import check_servers
    from pipeline.format.errors import PipelineError

    try:
        check_servers(definition)
    except PipelineError as exc:
        return str(exc)
    return None
