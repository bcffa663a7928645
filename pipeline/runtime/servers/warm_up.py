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

Through an app, every other bundle that records its request gets one such request too, and the
token ids the server's own code computed (seen at the bundle lookup) are compared with the
bundle's: the whole request path, route and engine, with nothing re-implemented. Where they part
at another token than the startup check predicted, one warning says where (`--strict`: serve
exits). For rapid-mlx, whose request code has no function short of its app to call, this is the
check of its own path.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, nullcontext
from typing import Any

from pipeline.format.errors import PipelineError

log = logging.getLogger("prefix-bundles")
WARMING = threading.Event()  # set while the warm-up request runs: hooks keep no entry of it


def recorded(mounted: Any) -> list[Any]:
    """The mounted bundles that record their request (older bundles record none), longest first."""
    found = [b for b in mounted.result.bundles if b.manifest.request is not None]
    return sorted(found, key=lambda b: (-len(b.tokens), b.name))


def longest_recorded(mounted: Any) -> Any | None:
    """The longest mounted bundle that records its request."""
    return next(iter(recorded(mounted)), None)


def api_of(bundle: Any, server: str) -> str:
    """The bundle's recorded API where the server serves it, else OpenAI chat completions."""
    from pipeline.runtime.servers.tokens import hook_of

    api = bundle.manifest.request.api
    return api if api == "openai" or hook_of(server).messages_route else "openai"


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


async def run_logged(
    server: str,
    mounted: Any,
    bundles: list[Any],
    send: Callable[[], Awaitable[None]],
    keeps_nothing: bool = True,
) -> bool:
    """Run `send` (the requests of `bundles`, the warm-up first) with WARMING set; one line saying
    what it took, or why it failed (False). `keeps_nothing`: the server stores nothing of them
    once `send` returns, so their bundles' hand-outs are provisional (PromptCacheManager)."""
    start = time.perf_counter()
    provisional = mounted.manager.provisional() if keeps_nothing else nullcontext()
    try:
        with warming(), provisional:
            await send()
    except Exception as exc:  # optional: the server serves without it
        log.warning("%s: warm-up failed (%s); serving without it", server, _one_line(exc))
        return False
    more = f" and {len(bundles) - 1} other bundles' requests" if len(bundles) > 1 else ""
    log.info(
        "%s: warmed up its generation path with %s's request%s in %.2f s before the port opened "
        "(--no-warm-up skips it)",
        server,
        bundles[0].name,
        more,
        time.perf_counter() - start,
    )
    return True


def through_app(
    app: Any,
    server: str,
    mounted: Any,
    model: Callable[[], str],
    headers: dict[str, str] | None = None,
    leave_no_entry: Callable[[], Callable[[], None]] | None = None,
) -> None:
    """Wrap `app`'s lifespan: once the server's own startup has run (model loaded), post each
    recorded bundle's request to the app in-process (the longest first: the warm-up), check the
    ids the server computed for each, then let uvicorn bind the port. `leave_no_entry`, when
    given, is called before each request and returns what undoes any entry the server's own code
    keeps outside the hooks. `model` gives the request's model name once the server has loaded
    (the name it validates requests against)."""
    bundles = recorded(mounted)
    if not bundles:
        return
    original = app.router.lifespan_context
    seen: dict[str, list[int] | None] = {}

    async def send(bundle: Any) -> None:
        import httpx

        api = api_of(bundle, server)
        route = "/v1/messages" if api == "anthropic" else "/v1/chat/completions"
        restore = leave_no_entry() if leave_no_entry is not None else (lambda: None)
        transport = httpx.ASGITransport(app=app)  # loopback host: rapid-mlx checks the Host
        try:
            async with httpx.AsyncClient(
                transport=transport, base_url="http://127.0.0.1"
            ) as client:
                body = body_of(bundle, model(), api)
                with looked_up(mounted.manager) as ids:
                    answer = await client.post(route, json=body, headers=headers, timeout=None)
        finally:
            restore()
        if answer.status_code != 200:
            raise RuntimeError(f"{route} answered {answer.status_code}: {answer.text}")
        seen[bundle.name] = ids[0] if ids else None

    async def every_bundle() -> None:
        for bundle in bundles:
            await send(bundle)

    @asynccontextmanager
    async def lifespan(app: Any) -> Any:
        async with original(app) as state:
            if await run_logged(server, mounted, bundles, every_bundle):
                try:
                    check_seen(server, mounted, bundles, seen)
                except PipelineError as exc:  # --strict: no port opens; the supervisor sees why
                    from pipeline.runtime.servers.startup import hard_exit

                    print(f"error: {exc}", file=sys.stderr)
                    hard_exit()
            yield state

    app.router.lifespan_context = lifespan


@contextmanager
def looked_up(manager: Any) -> Iterator[list[list[int]]]:
    """The token ids of every bundle lookup meanwhile (the hooks all ask `manager.fetch`)."""
    ids: list[list[int]] = []
    fetch = manager.fetch

    def recording(key: str, tokens: Any, *args: Any, **kwargs: Any) -> Any:
        ids.append([int(t) for t in tokens])
        return fetch(key, tokens, *args, **kwargs)

    manager.fetch = recording  # an instance attribute over the method, for this request only
    try:
        yield ids
    finally:
        del manager.fetch


def check_seen(
    server: str, mounted: Any, bundles: list[Any], seen: dict[str, list[int] | None]
) -> None:
    """Compare the ids the server's own app computed for each bundle's request with the bundle's:
    one line where they part at another token than the startup check predicted, one line for the
    rest. PipelineError under --strict when a bundle will not be reused whole."""
    from pipeline.runtime.servers.startup import server_tokenizer
    from pipeline.runtime.servers.tokens import ids_parity

    tokenizer, whole = None, 0
    for bundle in bundles:
        ids = seen.get(bundle.name)
        if ids is None:
            log.warning(
                "%s: %s's request through its app looked up no bundle: its ids were not checked",
                server,
                bundle.name,
            )
            continue
        tokenizer = tokenizer or server_tokenizer(mounted)
        p = ids_parity(server, tokenizer, bundle, ids, "app (its whole request path)")
        if p.reason is None:
            whole += 1
            continue
        line = f"{bundle.name}: requests will reuse at most {p.reusable} of its {p.total} tokens: {p.reason}"
        if mounted.strict:
            raise PipelineError(f"--strict: bundle {bundle.path}: {line}")
        if p.reusable != mounted.reusable.get(bundle.name):  # else the startup check said so
            log.warning("%s", line)
    log.info(
        "%s: its own app computed the ids of %d of %d recorded bundle(s) exactly as built",
        server,
        whole,
        len(bundles),
    )


def through_model(mounted: Any, model: Any) -> None:
    """For a server with no app to post to in-process (mlx_lm.server, from its generation thread
    once the model is loaded): the longest pinned bundle's cache through the model itself
    (PromptCacheManager.warm_up); one line saying what it took, a failure one warning."""
    from pipeline.runtime.servers.mounted import BUNDLE_KEY
    from pipeline.runtime.servers.startup import describe

    start = time.perf_counter()
    try:
        source = mounted.manager.warm_up(BUNDLE_KEY, model)
    except Exception as exc:  # optional: a failed warm-up must not stop the server
        log.warning("warm-up failed (%s); serving without it", describe(exc))
        return
    if source is not None:
        log.info(
            "warmed up from %s in %.1f ms (the first request now costs what an in-memory hit "
            "costs; --no-warm-up skips it)",
            source.removeprefix("bundle:"),
            (time.perf_counter() - start) * 1000,
        )


def through_vllm_app(
    server: Any, name: str, mounted: Any, options: Any, model: str, leave_no_entry: Any = None
) -> None:
    """`through_app` for vllm-mlx and its fork rapid-mlx: their `server` module's app, the model
    name it checks requests against once loaded (`_model_name`, else `model`), --api-key sent."""
    headers = api_key_headers(options.passed("--api-key"))
    served = lambda: server._model_name or model  # noqa: E731
    through_app(server.app, name, mounted, served, headers, leave_no_entry)


def api_key_headers(key: str | None) -> dict[str, str] | None:
    """What a client sends when the server was started with --api-key."""
    return None if key is None else {"Authorization": f"Bearer {key}", "x-api-key": key}


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__
