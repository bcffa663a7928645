"""How a server turns a request body into token ids, asked of the server's own code (each hook's
`request_ids`: pipeline.runtime.servers.<hook>), and what is server-neutral about it: request
bodies as clients send them, the Anthropic detection, the comparison with a bundle's ids.

`parity` is the fallback for bundles that carry no request (built before requests were
recorded): it re-encodes the bundle's text as the server encodes a rendered prompt.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.format.errors import PipelineError


def hook_of(server: str) -> Any:
    """The hook of a server the registry lists; PipelineError for another name."""
    from pipeline.runtime.servers.registry import hook_for

    return hook_for(server)


def has_request_code(server: str) -> bool:
    """Whether `server`'s own request code can be called short of its app (its hook defines
    `request_ids`; rapid-mlx renders inline in its route: its ids are checked through its own app
    at serve startup, pipeline.runtime.servers.warm_up)."""
    from pipeline.runtime.servers.hook import ServerHook

    return type(hook_of(server)).request_ids is not ServerHook.request_ids


def request_code_servers() -> list[str]:
    """The servers `request_ids` can ask, in the registry's order."""
    from pipeline.runtime.servers.registry import names

    return [name for name in names() if has_request_code(name)]


def anthropic_servers() -> list[str]:
    """The servers whose own request code follows an Anthropic messages body (/v1/messages)."""
    return [name for name in request_code_servers() if hook_of(name).messages_route]


def encode_text(server: str, tokenizer: Any, text: str) -> list[int]:
    """Token ids for rendered text, encoded the way `server` encodes a rendered prompt."""
    return hook_of(server).encode_text(tokenizer, text)


def is_anthropic(body: dict[str, Any]) -> bool:
    """An Anthropic Messages body (top-level `system`, or tools with `input_schema`)."""
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []  # checked by callers
    return "system" in body or any(isinstance(t, dict) and "input_schema" in t for t in tools)


def request_body(
    messages: list[dict[str, Any]],
    tools: list[dict] | None,
    template_kwargs: dict[str, Any],
    api: str = "openai",
) -> dict[str, Any]:
    """A request body for these messages and OpenAI-form tools, as a client sends it: OpenAI chat
    completions (template kwargs as `chat_template_kwargs`; omni's users send them as
    `extra_body`: request_ids moves them), or Anthropic messages (`api="anthropic"`: each system
    message one text block of `system`, tools with `input_schema`)."""
    if api == "anthropic":
        body: dict[str, Any] = {
            "system": [
                {"type": "text", "text": m["content"]} for m in messages if m["role"] == "system"
            ],
            "messages": [m for m in messages if m["role"] != "system"],
        }
        if tools is not None:
            body["tools"] = [
                {
                    "name": t["function"]["name"],
                    "description": t["function"].get("description") or "",
                    "input_schema": t["function"].get("parameters") or {"type": "object"},
                }
                for t in tools
            ]
    else:
        body = {"messages": messages}
        if tools is not None:
            body["tools"] = tools
    if template_kwargs:
        body["chat_template_kwargs"] = dict(template_kwargs)
    return body


def request_ids(server: str, tokenizer: Any, body: dict[str, Any], model_type: str) -> list[int]:
    """The token ids `server` computes for a request body (OpenAI chat completions, or Anthropic
    messages on anthropic_servers()), through the installed server's own code (its hook's
    `request_ids`). `tokenizer` is mlx-lm's TokenizerWrapper with the template the server would
    use; `model_type` is the model's config.json model_type (omni picks its tool format by it).
    PipelineError when the server is not installed here or refuses the request."""
    import importlib.util

    from pipeline.runtime.servers.options import install_hint

    hook = hook_of(server)
    if not has_request_code(server):
        raise PipelineError(
            f"{server}'s request code cannot be called short of its app (serve checks its ids "
            f"through its app at startup); choose one of {', '.join(request_code_servers())}"
        )
    if importlib.util.find_spec(hook.package.split(".")[0]) is None:
        raise PipelineError(
            f"{server} is not installed in this Python environment, so its own request code "
            f"cannot be run; {install_hint(server)}"
        )
    body = copy.deepcopy(body)  # servers change messages in place
    if is_anthropic(body) and server not in anthropic_servers():
        raise PipelineError(
            f"{server}: an Anthropic messages request is not served through a route serve checks; "
            f"give an OpenAI chat-completions body (Anthropic form: {', '.join(anthropic_servers())})"
        )
    try:
        return [int(t) for t in hook.request_ids(tokenizer, body, model_type)]
    except PipelineError:
        raise
    except Exception as exc:  # the server's own validation: its message, on one line
        text = " ".join(str(exc).split())
        raise PipelineError(f"{server} refuses the request: {text[:300]}") from None


@contextmanager
def quiet(name: str) -> Iterator[None]:
    """A server logger above INFO for a moment (omni logs every request's messages and tools)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def model_type(model_dir: Path) -> str:
    """config.json's model_type (omni's tool format follows it)."""
    return str(json.loads((Path(model_dir) / "config.json").read_text()).get("model_type", ""))


@dataclass(frozen=True)
class Parity:
    """How many of a bundle's tokens a server's own tokenization of its prefix keeps."""

    reusable: int  # leading bundle tokens the server's ids share
    total: int
    reason: str | None  # None when the server sees exactly the bundle's ids


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def parity(server: str, tokenizer: Any, bundle_ids: Sequence[int]) -> Parity:
    """Re-encode the bundle's prefix text as `server` does and compare with the bundle's ids."""
    ids = [int(t) for t in bundle_ids]
    text = tokenizer.decode(ids, skip_special_tokens=False)
    theirs = encode_text(server, tokenizer, text)
    if theirs[: len(ids)] == ids:
        return Parity(len(ids), len(ids), None)
    at = _common(theirs, ids)
    if len(theirs) > len(ids) and theirs[len(theirs) - len(ids) :] == ids:
        added = tokenizer.decode(theirs[: len(theirs) - len(ids)], skip_special_tokens=False)
        why = f"{server} adds {added!r} before the prefix (the tokenizer's special tokens)"
    else:
        why = (
            f"{server} encodes the prefix text differently from token {at} "
            f"(server {theirs[at : at + 4]}, bundle {ids[at : at + 4]})"
        )
    return Parity(at, len(ids), why)


PROBE_TURN = {"role": "user", "content": "Hello, can you help me?"}  # the builder's first probe


def request_parity(server: str, tokenizer: Any, bundle: Any, model_type: str) -> Parity:
    """How much of a mounted bundle `server`'s own request code keeps: its recorded request (the
    prefix and a user turn) through request_ids, or `parity` for a bundle that records none."""
    request = bundle.manifest.request
    ids = [int(t) for t in bundle.tokens]
    # rapid-mlx: no request code to call short of its app (warm_up checks a bundle through it)
    if request is None or not has_request_code(server):
        return parity(server, tokenizer, ids)
    messages = [m.model_dump() for m in request.messages] + [PROBE_TURN]
    tools = None if request.tools_json is None else json.loads(request.tools_json)
    body = request_body(messages, tools, request.template_kwargs, request.api)
    theirs = request_ids(server, tokenizer, body, model_type)
    return ids_parity(server, tokenizer, bundle, theirs, "own request code")


def ids_parity(server: str, tokenizer: Any, bundle: Any, theirs: Sequence[int], how: str) -> Parity:
    """How much of `bundle` the ids `server` computed for its recorded request (`how`: by what)
    keep, and where they part: the text on each side and what to do."""
    ids = [int(t) for t in bundle.tokens]
    at = _common([int(t) for t in theirs], ids)
    if at == len(ids):
        return Parity(at, len(ids), None)
    request = bundle.manifest.request
    built = ", ".join(request.tokenization if request else ()) or (
        "the builder's rendering (mlx_lm.server's path)"
    )
    fix = (
        f'add "{server}" to the definition\'s servers and rebuild'
        if has_request_code(server)
        else f"build the definition so its text renders as {server} renders it"
    )
    why = (
        f"{server}'s {how} parts from the bundle at token {at} ({server}: "
        f"{tokenizer.decode(list(theirs[at : at + 8]))!r}, bundle: "
        f"{tokenizer.decode(ids[at : at + 8])!r}; the bundle's ids follow {built}); {fix} "
        "(docs/servers.md)"
    )
    return Parity(at, len(ids), why)
