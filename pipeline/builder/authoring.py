"""Authoring help: a first definition for a model (`new`), and why a request does or does not reuse a bundle (`match`)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.builder.definition import ROLES, _parse_tools, load_definition
from pipeline.builder.plain_data import parse_json, toml_string
from pipeline.builder.stability import common_prefix_length
from pipeline.format.errors import DefinitionError, TemplateError
from pipeline.format.fingerprint import model_chat_template, sha256_text
from pipeline.format.names import NAME_HINT, is_name
from pipeline.format.regular_files import FileProblem, read_text
from pipeline.format.validate import Validated

STARTER_SYSTEM = "You are a helpful assistant. Replace this text with the prefix's system prompt.\n"


def _model_ref(model_dir: Path, repo_root: Path) -> str:
    """The model path as a definition writes it: relative to the repo root when inside it."""
    path = Path(model_dir).resolve()
    return str(path.relative_to(repo_root)) if path.is_relative_to(repo_root) else str(path)


def _read_input(path: Path, what: str) -> str:
    try:
        return read_text(Path(path), 64 << 20)
    except FileProblem as exc:
        raise DefinitionError(f"{what} {path}: {exc}; pass a readable UTF-8 file") from None


def new_definition(
    prefix_dir: Path, name: str, model_dir: Path, system_file: Path | None, tools_file: Path | None
) -> Path:
    """Write prefixes/<name>.toml (+ prefixes/<name>/) pinned to the model's template; return it."""
    system = _read_input(system_file, "--system-file") if system_file else STARTER_SYSTEM
    tools = _read_input(tools_file, "--tools") if tools_file else None
    if tools is not None:
        _parse_tools(tools, Path(tools_file))
    return _write_definition(prefix_dir, name, model_dir, [("system", system)], tools, {})


@dataclass(frozen=True)
class FromRequest:
    """What `new --from-request` wrote and what it left out."""

    path: Path
    api: str  # "openai" or "anthropic"
    notes: list[str]


BILLING_HEADER = "x-anthropic-billing-header:"  # Claude Code's per-request line (servers strip it)


def definition_from_request(
    prefix_dir: Path,
    name: str,
    model_dir: Path,
    request_file: Path,
    servers: list[str],
    prefix_messages: int = 0,
) -> FromRequest:
    """A definition from a request body (OpenAI chat completions or Anthropic messages, told
    apart by pipeline.runtime.servers.tokens.is_anthropic): its system part (and the first
    `prefix_messages` messages after it) as message files, its tools as tools.json. An Anthropic
    request's definition has api = "anthropic" and follows `servers` (default: vllm-mlx)."""
    from pipeline.runtime.servers.tokens import anthropic_servers, is_anthropic

    where = f"--from-request {request_file}"
    try:
        body = parse_json(_read_input(request_file, "--from-request"))
    except ValueError as exc:
        raise DefinitionError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        raise DefinitionError(
            f"{where}: give a request body, an object with a 'messages' list (OpenAI chat "
            "completions or Anthropic messages)"
        )
    if not isinstance(body.get("tools") or [], list):
        raise DefinitionError(f"{where}: tools: {_shown(body['tools'])} is not a list of tools")
    anthropic = is_anthropic(body)
    notes: list[str] = []
    if anthropic:
        messages = _anthropic_system(body.get("system"), where, notes)
        tools = [_openai_tool(t, where) for t in body.get("tools") or []] or None
        servers = servers or anthropic_servers()
    else:
        messages, tools = [], body.get("tools")
        while len(messages) < len(body["messages"]) and _role(
            body["messages"][len(messages)], f"{where}: messages.{len(messages)}"
        ) in ("system", "developer"):
            m, at = body["messages"][len(messages)], f"{where}: messages.{len(messages)}"
            messages.append((m["role"], _text(m.get("content"), at)))  # as captured
    rest = body["messages"] if anthropic else body["messages"][len(messages) :]
    if prefix_messages > len(rest):
        raise DefinitionError(
            f"{where}: --prefix-messages {prefix_messages}: the request has {len(rest)} message(s) "
            "after its system part"
        )
    for i, m in enumerate(rest[:prefix_messages]):
        at = f"{where}: messages.{i}"
        messages.append(
            (_role(m, at), _text(m.get("content") if isinstance(m, dict) else None, at))
        )
    if not messages:
        raise DefinitionError(
            f"{where}: the request has no system part; pass --prefix-messages N to make its first "
            "N messages the prefix"
        )
    dropped = _dropped_turns(model_dir, messages, tools, notes)
    extra = {"api": "anthropic"} if anthropic else {}
    if servers:
        extra["servers"] = servers
    tools_text = None if tools is None else json.dumps(tools, indent=2, ensure_ascii=False) + "\n"
    for i, (_, text) in enumerate(messages):
        if not _is_unicode(text):
            raise DefinitionError(
                f"{where}: prefix message {i} has text that is not Unicode (a lone surrogate such "
                "as \\ud800); fix the request"
            )
    if tools_text is not None and not _is_unicode(tools_text):
        raise DefinitionError(f"{where}: tools hold text that is not Unicode; fix the request")
    path = _write_definition(
        prefix_dir, name, model_dir, messages, tools_text, extra, where, dropped
    )
    return FromRequest(path, "anthropic" if anthropic else "openai", notes)


def _dropped_turns(
    model_dir: Path, messages: list[tuple[str, str]], tools: list | None, notes: list[str]
) -> set[int]:
    """The captured turns the model's template drops before a user turn, as the server the
    request was captured from does (Qwen3's templates drop a developer turn): marked
    dropped_by_template, with a note, so the prefix is what that server sends and build makes it
    (it refused the turn it could not see in the render)."""
    from pipeline.builder.render import special_tokens
    from pipeline.builder.template import render

    template = model_chat_template(model_dir)
    if template is None:  # _write_definition says so
        return set()
    turns = [{"role": role, "content": text} for role, text in messages]
    sent = render(
        template, [*turns, {"role": "user", "content": "?"}], tools=tools,
        special_tokens=special_tokens(model_dir),
    )  # fmt: skip
    dropped = {i for i, (_, text) in enumerate(messages) if text.strip() not in sent}
    for i in sorted(dropped):
        notes.append(
            f"messages.{i} ({messages[i][0]}): the model's chat template drops it, as the server "
            "does: kept as dropped_by_template, the prefix is what the server sends"
        )
    return dropped


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _role(message: Any, where: str) -> str:
    """A message's role from the fixed set a definition allows (it names a file: never a path)."""
    role = message.get("role") if isinstance(message, dict) else None
    if not isinstance(role, str) or role not in ROLES:
        raise DefinitionError(f"{where}: role {_shown(role)} is not one of {', '.join(ROLES)}")
    return role


def _shown(value: Any) -> str:
    """A value of a request as an error line shows it: JSON, ASCII, at most 60 characters."""
    return json.dumps(value, ensure_ascii=True)[:60]


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or text parts/blocks concatenated; DefinitionError otherwise."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise DefinitionError(f"{where}: content must be text (a string or text parts) to be a prefix")


def _anthropic_system(system: Any, where: str, notes: list[str]) -> list[tuple[str, str]]:
    """Each text block of an Anthropic `system` as one system message; billing-header blocks
    (per request) left out."""
    blocks = [{"type": "text", "text": system}] if isinstance(system, str) else system or []
    if not isinstance(blocks, list):
        raise DefinitionError(
            f"{where}: system: {_shown(system)} is neither a string nor a list of text blocks"
        )
    out = []
    for i, block in enumerate(blocks):
        text = _text([block], f"{where}: system.{i}")
        if text.lstrip().startswith(BILLING_HEADER):
            notes.append(f"system.{i} is a per-request {BILLING_HEADER} line: left out")
            continue
        out.append(("system", text))
    return out


def _openai_tool(tool: Any, where: str) -> dict[str, Any]:
    """An Anthropic tool ({name, description, input_schema}) as the OpenAI function tool a
    definition's tools_file holds."""
    if not isinstance(tool, dict) or "input_schema" not in tool or "name" not in tool:
        raise DefinitionError(
            f"{where}: tool {json.dumps(tool)[:80]} has no name and input_schema; only custom "
            "tools can be part of a prefix"
        )
    function = {"name": tool["name"], "description": tool.get("description") or ""}
    function["parameters"] = tool["input_schema"]
    return {"type": "function", "function": function}


def _write_definition(
    prefix_dir: Path,
    name: str,
    model_dir: Path,
    messages: list[tuple[str, str]],
    tools: str | None,
    extra: dict[str, Any],
    source: str | None = None,
    dropped: set[int] = frozenset(),
) -> Path:
    """Write prefixes/<name>.toml (+ one file per message and tools.json in prefixes/<name>/)
    pinned to the model's template; `extra` holds top-level keys (api, servers); `source`: what
    the content came from (`--from-request FILE`), named when the definition is refused.

    All or nothing: every file is written into a hidden staging folder inside prefix_dir, loaded
    back through the definition schema, then moved into place (the folder, then the .toml, which
    makes the definition visible). On any error the tree is as it was. Every file name comes from
    the validated name, a fixed role set and an index, so no input names a path.
    """
    prefix_dir = Path(prefix_dir)
    if not is_name(name):
        raise DefinitionError(f"name {name[:80]!r}: use {NAME_HINT}")
    bad = [role for role, _ in messages if role not in ROLES]
    if bad:  # callers validate roles; a file name is never made from anything else
        raise DefinitionError(f"role {_shown(bad[0])} is not one of {', '.join(ROLES)}")
    path, folder = prefix_dir / f"{name}.toml", prefix_dir / name
    _refuse_existing(path, folder)
    template = model_chat_template(model_dir)
    if template is None:
        raise TemplateError(
            f'model {model_dir}: ships no chat template; write a definition with template.source = "file"'
        )
    try:  # a new project's definitions folder is made, as build makes its bundles folder
        prefix_dir.mkdir(parents=True, exist_ok=True)
        repo_root = prefix_dir.resolve().parent
        stage = Path(tempfile.mkdtemp(prefix=f".new-{name}-", dir=prefix_dir))
    except OSError as exc:
        raise DefinitionError(f"cannot write in {prefix_dir}: {exc.strerror}") from None
    try:
        (stage / name).mkdir()
        lines = [f'name = "{name}"', "version = 1"]
        lines += [f"{key} = {_toml_value(value)}" for key, value in extra.items()]
        lines += ["", "[template]", 'source = "model"']
        lines += [f'sha256 = "{sha256_text(template)}"', "", "[prefix]"]
        if tools is not None:
            (stage / name / "tools.json").write_text(tools, encoding="utf-8")
            lines.append(f'tools_file = "{name}/tools.json"')
        for i, (role, text) in enumerate(messages):
            file = f"{role}.md" if len(messages) == 1 else f"{i + 1}-{role}.md"
            (stage / name / file).write_text(text, encoding="utf-8")
            lines += ["", "[[prefix.messages]]", f"role = {toml_string(role)}"]
            lines.append(f'content_files = ["{name}/{file}"]')
            if i in dropped:
                lines.append("dropped_by_template = true")
        model = _toml_value(_model_ref(model_dir, repo_root))
        lines += ["", "[[models]]", f"path = {model}", ""]
        (stage / path.name).write_text("\n".join(lines), encoding="utf-8")
        try:
            load_definition(stage / path.name, repo_root)
        except DefinitionError as exc:  # name the file as it would have been, not the staging
            said = str(exc).replace(str(stage / path.name), str(path))
            if source is not None:  # the input is to fix, not a file that was never written
                said = f"{source}: the definition made from it would be refused ({said})"
            raise DefinitionError(said) from None
        _move_into_place(stage, path, folder)
    except OSError as exc:
        raise DefinitionError(f"cannot write {path}: {exc.strerror}; nothing was written") from None
    except ValueError as exc:  # a lone surrogate: a path whose bytes are not UTF-8
        raise DefinitionError(f"cannot write {path}: {exc}; rename it") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return path


def _toml_value(value: str | list[str]) -> str:
    """A string or a list of strings as TOML (ValueError for a lone surrogate)."""
    if isinstance(value, str):
        return toml_string(value)
    return "[" + ", ".join(map(toml_string, value)) + "]"


def _refuse_existing(path: Path, folder: Path) -> None:
    """DefinitionError naming what exists of the definition (its .toml, or the folder beside it
    that would hold its files), even as a (dangling) link."""
    for taken in (path, folder):
        if os.path.lexists(taken):
            what = "folder " if os.path.isdir(taken) and not os.path.islink(taken) else ""
            raise DefinitionError(
                f"{what}{taken}: already exists; choose another name, or edit the definition and "
                "bump its version"
            )


def _move_into_place(stage: Path, path: Path, folder: Path) -> None:
    """The staged folder to `folder`, then the staged .toml to `path` (a hard link: it never
    replaces a file that appeared meanwhile); the folder is moved back if the .toml cannot be."""
    _refuse_existing(path, folder)
    os.rename(stage / folder.name, folder)
    try:
        os.link(stage / path.name, path, follow_symlinks=False)
    except OSError:
        os.rename(folder, stage / folder.name)
        _refuse_existing(path, folder)
        raise


@dataclass(frozen=True)
class Match:
    """How much of a request a bundle covers, what serve's rule lets it serve, and why not."""

    bundle: Path
    name: str
    bundle_tokens: int
    common_tokens: int  # leading tokens the request shares with the bundle
    reused_tokens: int  # what serve's rule lets it serve (pipeline.runtime.reusable_tokens)
    divergence: str | None  # where and how the request and the bundle differ
    lossy: bool  # quantized KV: served only for its share
    chosen: bool = False  # the bundle serve would use for this request
    why: str = ""  # why serve uses it, or why it loses


TRIMMABLE = {"KVCache", "QuantizedKVCache"}  # others are reused only when extended whole


def match_request(
    model_dir: Path, bundles: list[Validated], body: dict, server: str = "mlx-lm"
) -> tuple[list[int], list[Match]]:
    """The request's tokens as `server`'s own request code computes them
    (pipeline.runtime.servers.tokens), and each bundle's match under serve's reuse rule, the
    one serve would use first (none marked chosen: serve runs the request cold)."""
    from pipeline.builder.model_files import load_tokenizer
    from pipeline.runtime import lossy_min_tokens, preference, reusable_tokens
    from pipeline.runtime.servers.tokens import model_type, request_ids

    tokenizer = load_tokenizer(Path(model_dir))
    request = list(request_ids(server, tokenizer, body, model_type(model_dir)))
    out = []
    for b in bundles:
        common = common_prefix_length(b.tokens, request)
        trimmable = set(b.manifest.cache.classes) <= TRIMMABLE
        lossy = b.manifest.cache.kv_bits is not None
        reused = reusable_tokens(b.tokens, request, trimmable, lossy)
        whole = common == len(b.tokens)
        part = None if whole else _divergence(tokenizer, b.tokens, request, common)
        name = f"{b.manifest.prefix.name}@{b.manifest.prefix.version}"
        why = _why_not(common, reused, len(b.tokens), len(request), trimmable, lossy)
        if lossy and why is None:
            why = f"{b.manifest.cache.kv_bits}-bit KV, at least {lossy_min_tokens(len(b.tokens))}"
        out.append(Match(b.path, name, len(b.tokens), common, reused, part, lossy, why=why or ""))
    ranked = sorted(
        out, key=lambda m: preference(m.reused_tokens, m.lossy, m.bundle_tokens), reverse=True
    )
    if ranked and ranked[0].reused_tokens > 0:
        best = ranked[0]
        ranked[0] = dataclasses.replace(best, chosen=True, why=_chosen_why(best))
        for i, m in enumerate(ranked[1:], 1):
            if m.reused_tokens > 0:
                ranked[i] = dataclasses.replace(m, why=_loses_why(m, best))
    return request, ranked


def _loses_why(m: Match, best: Match) -> str:
    """Why a bundle that serves some of the request loses to the one serve uses (a tie is said
    as a tie, with the rule that breaks it: pipeline.runtime.preference)."""
    if m.reused_tokens < best.reused_tokens:
        return f"serves {m.reused_tokens}, {best.name} more ({best.reused_tokens})"
    if m.lossy and not best.lossy:
        return f"ties at {m.reused_tokens} tokens; {best.name} wins as full-precision KV"
    if m.bundle_tokens > best.bundle_tokens:
        return f"ties at {m.reused_tokens} tokens; {best.name} wins as it trims less"
    return f"ties at {m.reused_tokens} tokens with {best.name}; serve takes the first mounted"


def _why_not(
    common: int, reused: int, whole: int, total: int, trimmable: bool, lossy: bool
) -> str | None:
    """Why serve's rule gives a bundle no tokens of this request (None: it gives some)."""
    from pipeline.runtime import lossy_min_tokens

    if reused > 0:
        return None
    if common == 0:
        return "shares no token with the request"
    if not trimmable and common < whole:
        return f"its cache cannot be cut, and the request leaves it at token {common}"
    if not trimmable and whole >= total:
        return "its cache cannot be cut, and the request is no longer than it"
    if lossy:
        return (
            f"lossy KV is served only for at least {lossy_min_tokens(whole)} of its tokens "
            f"(the request shares {common})"
        )
    return "the request is one token long"


def _chosen_why(m: Match) -> str:
    left = "" if not m.lossy else f" ({m.why})"
    return f"serve would use it: {m.reused_tokens} of the request's tokens from it{left}"


def _divergence(tokenizer: Any, bundle: list[int], request: list[int], at: int) -> str:
    """Where the texts part: the character offset in the request and a few characters of each."""
    offset = len(tokenizer.decode(request[:at]))
    ours = tokenizer.decode(bundle[at : at + 8])
    theirs = tokenizer.decode(request[at : at + 8])
    return f"at token {at} (character {offset} of the request): bundle has {ours!r}, request has {theirs!r}"
