"""Cached-token usage fields for a server whose responses carry none or count them wrongly (an
OpenAI Usage model without `prompt_tokens_details`, Anthropic usage whose `input_tokens` counts
the reads too): the middleware, the per-request record, and the worker binding the engines use.

A request's served tokens are counted where its cache lookup runs, on the server's generation
worker thread, into the `Reuse` of that request: an HTTP middleware creates one per request in
a context variable, the engine's serialized runner (called from the request's own task, so the
context is the request's) binds it to the worker thread for the run, and the lookup records
into it. The middleware then writes the count into the response: `usage.prompt_tokens_details
.cached_tokens` (chat completions) or `usage.cache_read_input_tokens` (Anthropic messages),
never more than the lookup handed out, 0 when no lookup served the request; an Anthropic
`input_tokens` then counts only the prompt tokens not read from a cache (the server reports the
whole prompt there), so a client's sum is the prompt's length. In a stream, the
events a server sends before it generates (an Anthropic `message_start` carries usage) wait for
the lookup, so they carry the count too.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

ROUTES = {"/v1/chat/completions": "openai", "/v1/messages": "anthropic"}


@dataclass
class Reuse:
    """The tokens one request's cache lookup served (`looked_up`: the lookup has run)."""

    cached: int = 0
    looked_up: bool = False
    prompt: int | None = None  # the prompt's length as the lookup saw it (None: no lookup saw it)
    # the ids of the system prefix an engine's own snapshot cache keys (None: none)
    system_ids: list[int] | None = None


CURRENT: ContextVar[Reuse | None] = ContextVar("prefix_bundles_reuse", default=None)
_worker = threading.local()


def record(tokens: int, prompt: int | None = None) -> None:
    """On the generation worker: the running request's lookup served `tokens` tokens (of its
    `prompt` tokens, where the lookup saw them)."""
    reuse = getattr(_worker, "reuse", None)
    if reuse is not None:
        reuse.cached, reuse.looked_up = tokens, True
        reuse.prompt = prompt if prompt is not None else reuse.prompt


def note_prompt(prompt: int) -> None:
    """On the generation worker: the running request's prompt has `prompt` tokens."""
    reuse = getattr(_worker, "reuse", None)
    if reuse is not None:
        reuse.prompt = prompt


def worker_reuse() -> Reuse | None:
    """On the generation worker: the running request's Reuse (None: no request bound)."""
    return getattr(_worker, "reuse", None)


@contextmanager
def on_worker(reuse: Reuse | None) -> Iterator[None]:
    """Bind a request's Reuse to this (worker) thread while the request's work runs here."""
    _worker.reuse = reuse
    try:
        yield
    finally:
        _worker.reuse = None


def add_middleware(app: Any, counts: bool = True) -> None:
    """Count each chat or messages request's reuse and write it into the response's usage.
    `counts=False`: a server that reports its reads itself (`cache_read_input_tokens`) but counts
    them in `input_tokens` too (mlx-omni-server): its Anthropic usage is only set right."""
    from starlette.responses import Response

    @app.middleware("http")
    async def cached_tokens(request: Any, call_next: Any) -> Any:
        api = ROUTES.get(request.url.path)
        if api is None or request.method != "POST" or (api == "openai" and not counts):
            return await call_next(request)
        reuse = Reuse() if counts else None
        token = CURRENT.set(reuse)
        try:
            response = await call_next(request)
        finally:
            CURRENT.reset(token)
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            response.body_iterator = _events_with_usage(response.body_iterator, reuse, api)
            return response
        body = b"".join([chunk async for chunk in response.body_iterator])
        headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
        return Response(
            _with_usage(body, reuse, api),
            status_code=response.status_code,
            headers=headers,
            media_type=response.media_type,
        )


def _set_usage(usage: Any, reuse: Reuse | None, api: str) -> None:
    if not isinstance(usage, dict):
        return
    if reuse is None:  # the server's own count of what it read (None: nothing)
        read = usage.get("cache_read_input_tokens")
        reuse = Reuse(read if isinstance(read, int) else 0, True)
    if api == "openai":
        details = usage.get("prompt_tokens_details")
        details = details if isinstance(details, dict) else {}
        usage["prompt_tokens_details"] = {**details, "cached_tokens": reuse.cached}
    elif isinstance(usage.get("input_tokens"), int):  # the message's usage, not output only
        # Anthropic: input_tokens counts what was NOT read from a cache; a client's total is
        # input_tokens + cache_creation_input_tokens + cache_read_input_tokens
        # (vllm-mlx's message_start, sent before it counts the prompt, says 0 there: the
        # prompt's length as the lookup saw it stands in)
        whole = reuse.prompt if reuse.prompt is not None else usage["input_tokens"]
        usage["cache_read_input_tokens"] = reuse.cached
        usage["input_tokens"] = max(0, whole - reuse.cached)


def _with_usage(body: bytes, reuse: Reuse | None, api: str) -> bytes:
    """A JSON response body with the usage fields set (other bodies unchanged)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body
    if not isinstance(data, dict) or "usage" not in data:
        return body
    _set_usage(data["usage"], reuse, api)
    return json.dumps(data).encode()


# Anthropic stream events a server sends before generating (vllm-mlx: before its engine looks the
# prompt up): held back until the lookup has run or generation output arrives
PREAMBLE = ("message_start", "content_block_start", "ping")


async def _events_with_usage(events: Any, reuse: Reuse | None, api: str) -> Any:
    """Server-sent events with the usage fields set in every event that carries usage. The
    events before generation (PREAMBLE: an Anthropic `message_start` carries usage) are held
    until the lookup has run, or the first generated event arrives, so they report it too."""
    pending, held = b"", []
    async for chunk in events:
        pending += chunk.encode() if isinstance(chunk, str) else chunk
        *done, pending = pending.split(b"\n\n")
        for event in done:
            held.append(event)
            if reuse is None or reuse.looked_up or _event_type(event) not in PREAMBLE:
                for ready in held:
                    yield _event_with_usage(ready, reuse, api) + b"\n\n"
                held = []
    for ready in held:
        yield _event_with_usage(ready, reuse, api) + b"\n\n"
    if pending:
        yield pending


def _event_type(event: bytes) -> str | None:
    """The `type` of an event's JSON data (None for other events)."""
    for line in event.split(b"\n"):
        if line.startswith(b"data: "):
            try:
                data = json.loads(line[6:])
            except ValueError:
                return None
            return data.get("type") if isinstance(data, dict) else None
    return None


def _event_with_usage(event: bytes, reuse: Reuse | None, api: str) -> bytes:
    lines = event.split(b"\n")
    for i, line in enumerate(lines):
        if not line.startswith(b"data: ") or b'"usage"' not in line:
            continue
        try:
            data = json.loads(line[6:])
        except ValueError:
            continue
        if isinstance(data, dict):
            _set_usage(data.get("usage"), reuse, api)
            message = data.get("message")
            if isinstance(message, dict):  # Anthropic message_start
                _set_usage(message.get("usage"), reuse, api)
            lines[i] = b"data: " + json.dumps(data).encode()
    return b"\n".join(lines)
