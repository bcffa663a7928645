"""Warm-up before the port opens, for the servers serve wraps.

A fresh process's first request pays for more than its prefill: kernel and BLAS set-up, the first
copy of a bundle-sized cache, objects servers build lazily (omni loads its model on the first
request that names it). A bundle removes the prefill, not those. So once a server has loaded its
model, and before it listens, serve sends one request of the longest mounted bundle's recorded
form (its prefix and a one-line user turn, 2 tokens at temperature 0) through that server's own
request handling: its ASGI app in-process for the FastAPI servers, its handler in
mlx-openai-server's model process. The request leaves no cache entry behind (while `WARMING` is
set, the hooks store nothing) and the bundles untouched (lookups hand out copies). A failed
warm-up is one warning; the server serves without it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

log = logging.getLogger("prefix-bundles")
WARMING = threading.Event()  # set while the warm-up request runs: hooks keep no entry of it


def longest_recorded(mounted: Any) -> Any | None:
    """The longest mounted bundle that records its request (older bundles record none)."""
    recorded = [b for b in mounted.result.bundles if b.manifest.request is not None]
    return max(recorded, key=lambda b: (len(b.tokens), b.name), default=None)


def api_of(bundle: Any, server: str) -> str:
    """The bundle's recorded API where the server serves it, else OpenAI chat completions."""
    from pipeline.runtime.servers.tokens import ANTHROPIC_ROUTES

    api = bundle.manifest.request.api
    return api if api == "openai" or server in ANTHROPIC_ROUTES else "openai"


def body_of(bundle: Any, model: str, api: str) -> dict[str, Any]:
    """The bundle's recorded request with a user turn, as a client sends it (greedy; 2 tokens:
    omni 0.5.3 answers max_tokens=1 with "No tokens generated")."""
    from pipeline.runtime.servers.tokens import PROBE_TURN, request_body

    r = bundle.manifest.request
    messages = [m.model_dump() for m in r.messages] + [PROBE_TURN]
    tools = None if r.tools_json is None else json.loads(r.tools_json)
    body = request_body(messages, tools, r.template_kwargs, api)
    return {**body, "model": model, "max_tokens": 2, "temperature": 0.0, "stream": False}


@contextmanager
def warming() -> Iterator[None]:
    WARMING.set()
    try:
        yield
    finally:
        WARMING.clear()


async def run_logged(server: str, bundle: Any, send: Callable[[], Awaitable[None]]) -> None:
    """Run `send` with WARMING set; one line saying what it took, or why it failed."""
    start = time.perf_counter()
    try:
        with warming():
            await send()
    except Exception as exc:  # optional: the server serves without it
        log.warning("%s: warm-up failed (%s); serving without it", server, _one_line(exc))
        return
    log.info(
        "%s: warmed up its generation path with %s's request in %.2f s before the port opened "
        "(--no-warm-up skips it)",
        server,
        bundle.name,
        time.perf_counter() - start,
    )


def through_app(
    app: Any,
    server: str,
    mounted: Any,
    model: Callable[[], str],
    headers: dict[str, str] | None = None,
    leave_no_entry: Callable[[], Callable[[], None]] | None = None,
) -> None:
    """Wrap `app`'s lifespan: once the server's own startup has run (model loaded), post the
    warm-up request to the app in-process, then let uvicorn bind the port. `leave_no_entry`, when
    given, is called before the request and returns what undoes any entry the server's own code
    keeps outside the hooks. `model` gives the request's model name once the server has loaded
    (the name it validates requests against)."""
    bundle = longest_recorded(mounted)
    if bundle is None:
        return
    original = app.router.lifespan_context
    api = api_of(bundle, server)
    route = "/v1/messages" if api == "anthropic" else "/v1/chat/completions"

    async def send() -> None:
        import httpx

        restore = leave_no_entry() if leave_no_entry is not None else (lambda: None)
        transport = httpx.ASGITransport(app=app)  # loopback host: rapid-mlx checks the Host
        try:
            async with httpx.AsyncClient(
                transport=transport, base_url="http://127.0.0.1"
            ) as client:
                body = body_of(bundle, model(), api)
                answer = await client.post(route, json=body, headers=headers, timeout=None)
        finally:
            restore()
        if answer.status_code != 200:
            raise RuntimeError(f"{route} answered {answer.status_code}: {answer.text}")

    @asynccontextmanager
    async def lifespan(app: Any) -> Any:
        async with original(app) as state:
            await run_logged(server, bundle, send)
            yield state

    app.router.lifespan_context = lifespan


def api_key_headers(key: str | None) -> dict[str, str] | None:
    """What a client sends when the server was started with --api-key."""
    return None if key is None else {"Authorization": f"Bearer {key}", "x-api-key": key}


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__
