"""How each server turns a request body into token ids, by the server's own code.

`request_ids` runs a request through the installed server's own request models, message and
tool conversion, template call and encode step (stand-ins carry only the tokenizer where the
server's step is a method): mlx_lm.server's `ResponseGenerator._tokenize`; vllm-mlx 0.6's
`ChatCompletionRequest` / `AnthropicRequest` + `anthropic_to_openai`, `_prepare_chat_messages`,
`convert_tools_for_template` and `SimpleEngine._render_chat_prompt`; mlx-omni-server 0.5's
`ChatCompletionRequest`, `OpenAIAdapter._prepare_generation_params` and
`ChatGenerator._prepare_prompt`; mlx-openai-server 1.8's `ChatCompletionRequest`,
`MLXLMHandler._prepare_text_request` / `refine_messages` and `MLX_LM.create_input_prompt`. Only
vllm-mlx's encode rule is inline in its engine (add special tokens unless the text starts with
BOS); it is `encode_text` here.

`parity` is the fallback for bundles that carry no request (built before requests were
recorded): it re-encodes the bundle's text as the server encodes a rendered prompt.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pipeline.format.errors import PipelineError

ANTHROPIC_SERVERS = ("vllm-mlx",)  # servers whose /v1/messages route request_ids follows
ANTHROPIC_ROUTES = ("vllm-mlx", "rapid-mlx")  # servers that serve /v1/messages at all
PACKAGES = {
    "mlx-lm": "mlx_lm.server",
    "vllm-mlx": "vllm_mlx.server",
    "mlx-omni-server": "mlx_omni_server.chat.openai.openai_adapter",
    "mlx-openai-server": "app.handler.mlx_lm",
}
# the servers whose request code can be called (rapid-mlx renders inline in its route: its ids are
# checked through its own app at serve startup, pipeline.runtime.servers.warm_up)
SERVER_NAMES: tuple[str, ...] = tuple(PACKAGES)


def encode_text(server: str, tokenizer: Any, text: str) -> list[int]:
    """Token ids for rendered text, encoded the way `server` encodes a rendered prompt."""
    if server == "mlx-lm":
        return list(tokenizer.encode(text, add_special_tokens=False))
    if server == "vllm-mlx":
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not text.startswith(bos)
        return list(tokenizer.encode(text, add_special_tokens=add_special))
    # omni, mlx-openai-server, rapid-mlx (its scheduler encodes): the tokenizer's default
    return list(tokenizer.encode(text))


def is_anthropic(body: dict[str, Any]) -> bool:
    """An Anthropic Messages body (top-level `system`, or tools with `input_schema`)."""
    tools = body.get("tools") or []
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
    messages on ANTHROPIC_SERVERS), through the installed server's own code. `tokenizer` is
    mlx-lm's TokenizerWrapper with the template the server would use; `model_type` is the model's
    config.json model_type (omni picks its tool format by it). PipelineError when the server is
    not installed here or refuses the request."""
    import importlib.util

    if server not in PACKAGES:
        raise PipelineError(f"unknown server {server!r}; choose one of {', '.join(SERVER_NAMES)}")
    if importlib.util.find_spec(PACKAGES[server].split(".")[0]) is None:
        raise PipelineError(
            f"{server} is not installed in this Python environment, so its own request code "
            f"cannot be run; install it (\"pip install 'mlx-prefix-bundles[{server}]'\") here"
        )
    body = copy.deepcopy(body)  # servers change messages in place
    anthropic = is_anthropic(body)
    if anthropic and server not in ANTHROPIC_SERVERS:
        raise PipelineError(
            f"{server}: an Anthropic messages request is not served through a route serve checks; "
            f"give an OpenAI chat-completions body (Anthropic form: {', '.join(ANTHROPIC_SERVERS)})"
        )
    try:
        return [int(t) for t in _PATHS[server](tokenizer, body, model_type)]
    except PipelineError:
        raise
    except Exception as exc:  # the server's own validation: its message, on one line
        text = " ".join(str(exc).split())
        raise PipelineError(f"{server} refuses the request: {text[:300]}") from None


def _mlx_lm(tokenizer: Any, body: dict[str, Any], model_type: str) -> list[int]:
    from mlx_lm.server import ResponseGenerator

    cli = SimpleNamespace(chat_template_args={})
    generator = SimpleNamespace(model_provider=SimpleNamespace(cli_args=cli, processor=None))
    request = SimpleNamespace(
        request_type="chat",
        messages=body["messages"],
        tools=body.get("tools"),
        role_mapping=body.get("role_mapping"),
    )
    args = SimpleNamespace(chat_template_kwargs=body.get("chat_template_kwargs"))
    return ResponseGenerator._tokenize(generator, tokenizer, request, args)[0]


def vllm_request(body: dict[str, Any]) -> Any:
    """vllm-mlx's ChatCompletionRequest for a body, an Anthropic one through its own converter."""
    from vllm_mlx.api.models import ChatCompletionRequest

    body = {"model": "model", **body}
    if not is_anthropic(body):
        return ChatCompletionRequest(**body)
    from vllm_mlx.api.anthropic_adapter import anthropic_to_openai
    from vllm_mlx.api.anthropic_models import AnthropicRequest

    return anthropic_to_openai(AnthropicRequest(**{"max_tokens": 1, **body}))


def _vllm_mlx(tokenizer: Any, body: dict[str, Any], model_type: str) -> list[int]:
    from vllm_mlx import server
    from vllm_mlx.api.tool_calling import convert_tools_for_template
    from vllm_mlx.engine.simple import SimpleEngine

    request = vllm_request(body)
    engine = SimpleNamespace(is_mllm=False, preserve_native_tool_format=False)
    messages = server._prepare_chat_messages(engine, request.messages)[0]
    tools = None
    if request.tools and request.tool_choice != "none":
        tools = convert_tools_for_template(request.tools)
    stand_in = SimpleNamespace(_model=SimpleNamespace(tokenizer=tokenizer), _model_name="model")
    kwargs = dict(request.chat_template_kwargs or {})
    prompt = SimpleEngine._render_chat_prompt(stand_in, messages, tools, kwargs, None)[0]
    return encode_text("vllm-mlx", tokenizer, prompt)


def _omni(tokenizer: Any, body: dict[str, Any], model_type: str) -> list[int]:
    from mlx_omni_server.chat.mlx.chat_generator import ChatGenerator
    from mlx_omni_server.chat.mlx.tools.chat_template import ChatTemplate
    from mlx_omni_server.chat.openai.openai_adapter import OpenAIAdapter
    from mlx_omni_server.chat.openai.schema import ChatCompletionRequest

    body.setdefault("model", "model")
    if "chat_template_kwargs" in body:  # omni reads template kwargs from extra_body
        body["extra_body"] = body.pop("chat_template_kwargs")
    generator = SimpleNamespace(chat_template=ChatTemplate(model_type, tokenizer))
    with _quiet("mlx_omni"):
        params = OpenAIAdapter._prepare_generation_params(
            SimpleNamespace(_default_max_tokens=1), ChatCompletionRequest(**body)
        )
        prompt = ChatGenerator._prepare_prompt(
            generator, params["messages"], params["tools"], params["template_kwargs"]
        )
    return tokenizer.encode(prompt)


@contextmanager
def _quiet(name: str) -> Iterator[None]:
    """A server logger above INFO for a moment (omni logs every request's messages and tools)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _openai_server(tokenizer: Any, body: dict[str, Any], model_type: str) -> list[int]:
    from app.handler.mlx_lm import MLXLMHandler
    from app.models.mlx_lm import MLX_LM
    from app.schemas.openai import ChatCompletionRequest

    body.setdefault("model", "model")
    handler = MLXLMHandler.__new__(MLXLMHandler)  # its methods, none of its model or workers
    handler.__dict__.update(kv_bits=None, kv_group_size=64, quantized_kv_start=0)
    handler.__dict__.update(message_converter=None, _disable_batching=True)
    prepare = MLXLMHandler._prepare_text_request(handler, ChatCompletionRequest(**body))
    messages, params = asyncio.run(prepare)
    messages = MLXLMHandler.refine_messages(handler, messages)
    model = SimpleNamespace(tokenizer=tokenizer)
    prompt = MLX_LM.create_input_prompt(model, messages, params.get("chat_template_kwargs", {}))
    return MLX_LM.encode_prompt(model, prompt)


_PATHS = {
    "mlx-lm": _mlx_lm,
    "vllm-mlx": _vllm_mlx,
    "mlx-omni-server": _omni,
    "mlx-openai-server": _openai_server,
}


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
    if request is None or server not in _PATHS:
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
        if server in _PATHS
        else f"build the definition so its text renders as {server} renders it"
    )
    why = (
        f"{server}'s {how} parts from the bundle at token {at} ({server}: "
        f"{tokenizer.decode(list(theirs[at : at + 8]))!r}, bundle: "
        f"{tokenizer.decode(ids[at : at + 8])!r}; the bundle's ids follow {built}); {fix} "
        "(docs/servers.md)"
    )
    return Parity(at, len(ids), why)
