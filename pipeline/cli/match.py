"""`match`: which bundle serve would use for a chat request, how many tokens, and why the others lose."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline.cli.common import add_json_option, emit_json, err, request_code_server, say
from pipeline.cli.keys import add_trusted_key_option, trusted_keys
from pipeline.format.errors import PipelineError, UsageError


def add_parser(sub: argparse._SubParsersAction, parents: list) -> None:
    m = sub.add_parser(
        "match",
        parents=parents,
        help="which bundle serve would use for a chat request, and why the others lose",
        description="Decides as serve does (the one reuse rule: at least one token left, lossy "
        "bundles only for their share). Exit 0 when serve would reuse at least --min-share of "
        "the chosen bundle's tokens, 1 when it would reuse less or run the request cold.",
    )
    m.add_argument("--model", type=Path, required=True, help="the served model folder")
    source = m.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--prompt-file",
        type=Path,
        help="a request body as a client sends it: OpenAI chat completions or Anthropic "
        "messages (told apart as `new --from-request` does)",
    )
    source.add_argument("--messages", help="the request's messages as a JSON list (OpenAI form)")
    m.add_argument(
        "--server",
        type=request_code_server,
        metavar="SERVER",
        default=None,
        help="tokenize the request as this server's own request code does (default: mlx-lm, "
        "i.e. mlx_lm.server; an Anthropic body: the first server whose request code follows "
        "one, vllm-mlx)",
    )
    m.add_argument(
        "--lockfile",
        type=Path,
        help="as serve --lockfile: only the versions this prefixes.lock names are considered",
    )
    m.add_argument(
        "--min-share",
        type=_share,
        default=DEFAULT_MIN_SHARE,
        metavar="PERCENT",
        help="the share of the chosen bundle's tokens serve must reuse for exit 0 (default "
        f"{DEFAULT_MIN_SHARE:.0%}%: a request sharing only a template's opening tokens fails)",
    )
    add_json_option(m, "match")
    add_trusted_key_option(m)  # as serve's: an unsigned bundle is not considered
    # --bundles defaults to <model>/prefix-bundles, where serve looks
    m.set_defaults(func=run, bundles_near_model="read")


def _body(args: argparse.Namespace) -> tuple[dict, str]:
    """The request body as a server receives it, and where it came from (for errors)."""
    from pipeline.builder.request import parse_request
    from pipeline.format.regular_files import FileProblem, read_text
    from pipeline.runtime.servers.tokens import is_anthropic, request_body

    where = f"--prompt-file {args.prompt_file}" if args.prompt_file else "--messages"
    try:
        raw = read_text(args.prompt_file, 64 << 20) if args.prompt_file else args.messages
        body = json.loads(raw)
    except FileProblem as exc:
        raise PipelineError(f"{where}: {exc}") from None
    except (ValueError, RecursionError) as exc:
        hint = "" if args.prompt_file else "; to pass a request body from a file use --prompt-file"
        error = PipelineError if args.prompt_file else UsageError  # a file's content: not usage
        raise error(f"{where}: not valid JSON ({exc}){hint}") from None
    if isinstance(body, dict) and is_anthropic(body):
        return body, "anthropic"
    messages, tools = parse_request(body, where)
    return request_body(messages, tools, {}), "openai"


def run(args: argparse.Namespace) -> int:
    from pipeline.builder.authoring import match_request
    from pipeline.format.errors import BundleError
    from pipeline.format.validate import validate
    from pipeline.runtime.mount import identity_for, model_bundles_dir
    from pipeline.runtime.servers.tokens import anthropic_servers

    body, api = _body(args)
    anthropic = anthropic_servers() if api == "anthropic" else []
    server = args.server or (anthropic[0] if anthropic else "mlx-lm")
    if anthropic and server not in anthropic:
        raise PipelineError(
            f"--server {server}: an Anthropic messages body is checked through "
            f"{', '.join(anthropic)}'s /v1/messages route; pass --server {anthropic[0]} or an "
            "OpenAI chat-completions body"
        )
    identity = identity_for(args.model)
    keys = trusted_keys(args)
    bundles = args.bundles or model_bundles_dir(args.model)  # where serve looks
    chosen_paths, skipped = _mounted(bundles, args.lockfile)
    valid = []
    for path in chosen_paths:
        try:
            valid.append(validate(path, identity, trusted_keys=keys))
        except BundleError as exc:
            skipped.append(str(exc))
    request, matches = match_request(args.model, valid, body, server)
    chosen = next((m for m in matches if m.chosen), None)
    share = chosen.reused_tokens / chosen.bundle_tokens if chosen else 0.0
    passed = chosen is not None and share >= args.min_share
    if args.json:
        _emit(server, api, request, matches, chosen, skipped, (share, args.min_share, passed))
    else:
        _print(server, request, matches, chosen, skipped, bundles)
        if chosen is not None:
            said = "at least" if passed else "below"
            say(
                f"{'ok' if passed else 'fails'}: {chosen.reused_tokens:,} of {chosen.name}'s "
                f"{chosen.bundle_tokens:,} tokens reused ({share:.1%}), {said} --min-share "
                f"{args.min_share:.0%}"
            )
    return 0 if passed else 1


DEFAULT_MIN_SHARE = 0.5


def _share(text: str) -> float:
    """argparse type of --min-share: a percentage 0-100 ('90', '90%') or a fraction ('0.9')."""
    try:
        value = float(text.strip().removesuffix("%"))
    except ValueError:
        value = -1.0
    share = value / 100 if text.strip().endswith("%") or value > 1 else value
    if not 0 <= share <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a share; give a percentage 0-100 (90%)")
    return share


def _mounted(bundles: Path, lockfile: Path | None) -> tuple[list[Path], list[str]]:
    """The bundles serve would try to mount (the newest, or the lockfile's versions), and what
    it would not mount, with why."""
    from pipeline.format.lockfile import locked_folders, locked_versions
    from pipeline.runtime.mount import choose_versions, find_bundles, version_key

    versions = locked_versions(lockfile) if lockfile else None
    paths, problems = find_bundles(bundles)
    skipped = [f"{p.path}: {p.reason}" for p in problems]  # what serve would not mount either
    folders = locked_folders(lockfile) if lockfile else None
    chosen, other = choose_versions(bundles, paths, versions, folders)
    for path in other:
        key = version_key(bundles, path)
        if versions is not None and key is not None and key[0][0] not in versions:
            skipped.append(f"{path}: prefix {key[0][0]} is not in the lockfile {lockfile}")
    return chosen, skipped


def _print(server, request, matches, chosen, skipped, bundles) -> None:
    for line in skipped:
        err(f"bundle {line} (not considered)")
    as_server = "" if server == "mlx-lm" else f" ({server})"
    say(f"request: {len(request)} tokens{as_server}")
    for m in matches:
        mark = "*" if m.chosen else " "
        part = f"; parts {m.divergence}" if m.divergence else ""
        say(f"{mark} {m.name:<24} {m.reused_tokens:>6} of {m.bundle_tokens:<6} {m.why}{part}")
        say(f"  {'':<24} {m.bundle}")
    if chosen is None:
        where = "" if matches else f" (no valid bundle in {bundles})"
        say(f"serve would run this request cold: no bundle is reused{where}")


def _emit(server, api, request, matches, chosen, skipped, gate) -> None:
    from pipeline.cli.reports import MatchedBundle, MatchReport

    rows = [
        MatchedBundle(
            name=m.name, path=str(m.bundle), bundle_tokens=m.bundle_tokens,
            common_tokens=m.common_tokens, reused_tokens=m.reused_tokens, lossy=m.lossy,
            chosen=m.chosen, why=m.why, divergence=m.divergence,
        )
        for m in matches
    ]  # fmt: skip
    emit_json(
        MatchReport(
            server=server, api=api, request_tokens=len(request),
            chosen=chosen.name if chosen else None, bundles=rows, not_considered=skipped,
            share=gate[0], min_share=gate[1], passed=gate[2],
        )
    )  # fmt: skip
