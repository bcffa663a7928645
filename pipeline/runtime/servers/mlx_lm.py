"""`serve` (the default server): mlx_lm.server with bundles mounted before the first request is
accepted.

Errors are raised (PipelineError); the CLI (pipeline.cli.serve) parses options and prints.

The hook replaces three names in mlx_lm.server before its main() runs: `LRUPromptCache` (a
subclass that answers from the mounted bundles when they cover more of the prompt than the
server's own entries, and hands the batched path only caches it can merge), `ModelProvider`
(optional warm-up) and `ResponseGenerator` (a dead generation thread ends the process; the prompt
cache is told which path fetches). Everything else (options, HTTP, generation) is mlx_lm.server's.

With `--snapshots DIR` (SNAPSHOTS: this hook supports them) the prompt cache also answers from the
snapshots restored at startup (pipeline.runtime.snapshots), stamps each entry it stores, and at a
graceful stop (SIGTERM, SIGINT) its entries are listed (`listed_entries`) and saved.
"""

from __future__ import annotations

import _thread
import argparse
import logging
import signal
import sys
import threading
import time
from typing import Any

from pipeline.format.errors import PipelineError
from pipeline.runtime.lookup import lookup
from pipeline.runtime.mount import MountedBundle
from pipeline.runtime.prompt_cache import PromptCacheManager, at_least_one_left, is_lossy
from pipeline.runtime.servers.startup import (
    BUNDLE_KEY,
    check_tokenization,
    describe,
    hard_exit,
    hub_cache_or_none,
    passed_option,
    start,
)
from pipeline.runtime.snapshot_store import Entry
from pipeline.runtime.snapshots import Snapshots, parse_size

log = logging.getLogger("prefix-bundles")
SERVER = "mlx_lm.server"
ADDRESS = ("127.0.0.1", 8080)  # where it binds when its options do not say
SNAPSHOTS = True  # serve --snapshots: this hook lists and restores its server's entries


def bundled_prompt_cache_class(
    manager: PromptCacheManager, model_path: str, snapshots: Snapshots | None = None
) -> type:
    """A LRUPromptCache subclass that also answers from the bundles pinned in `manager` (and the
    restored `snapshots`), and hands the batched path only caches it can merge (see
    pipeline.runtime.batching)."""
    from mlx_lm.server import LRUPromptCache

    class BundledPromptCache(LRUPromptCache):
        single_path = False  # True while the ResponseGenerator serves a request on its own
        instances: list[Any] = []  # the server's instance, listed at a graceful stop

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.stamps: dict[tuple[int, ...], int] = {}  # recency, for snapshots
            BundledPromptCache.instances.append(self)

        def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[Any, list[int]]:
            own = super().fetch_nearest_cache
            if model != (model_path, None, None) or not tokens:
                return at_least_one_left(lambda t: own(model, t), tokens)
            fetch = lambda t: own(model, t)  # noqa: E731
            if snapshots is not None:
                fetch = with_snapshots(fetch, snapshots, manager)
            return lookup(SERVER, manager, BUNDLE_KEY, tokens, fetch, not self.single_path)

        def insert_cache(self, model: Any, tokens: list[int], *args: Any, **kwargs: Any) -> None:
            super().insert_cache(model, tokens, *args, **kwargs)
            if snapshots is not None:
                # on the generation thread: its arrays are lazy on that thread's stream, which
                # the main thread that saves them at a stop cannot evaluate
                evaluate(args[0] if args else kwargs.get("prompt_cache"))
                self.stamps[tuple(tokens)] = snapshots.tick()
                if len(self.stamps) > 4 * max(len(self), 16):  # forget evicted entries' stamps
                    live = {tuple(t) for lru in self._lru._lrus.values() for _, t in lru}
                    self.stamps = {k: v for k, v in self.stamps.items() if k in live}

    return BundledPromptCache


def evaluate(cache: Any) -> None:
    """Evaluate every array a prompt cache holds, on this thread."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    states = [layer.state for layer in cache or []]
    mx.eval([a for _, a in tree_flatten(states) if isinstance(a, mx.array)])


def with_snapshots(own: Any, snapshots: Snapshots, manager: PromptCacheManager) -> Any:
    """The server's own fetch, or a restored snapshot where it covers more than both the
    server's own entry and every pinned bundle (a tie goes to those: a snapshot never beats an
    exact bundle). A server entry sharing its opening with a lossy snapshot is held to its rule."""

    def fetch(tokens: list[int]) -> tuple[Any, list[int]]:
        cache, rest = own(tokens)
        covered = len(tokens) - len(rest) if cache is not None else 0
        if cache is not None and covered < snapshots.lossy_floor(tokens):
            cache, rest, covered = None, tokens, 0
        bundle = manager.covered(BUNDLE_KEY, tokens)
        found, keep, name = snapshots.fetch(tokens, max(covered, bundle))
        if found is None:
            return cache, rest
        log.info(
            "%s request: snapshot %s covers %d of %d prompt tokens", SERVER, name, keep, len(tokens)
        )
        return found, list(tokens[keep:])

    return fetch


def listed_entries(
    prompt_cache: Any, model_key: Any, manager: PromptCacheManager, snapshots: Snapshots,
    bundles: list[Any],
) -> list[tuple[int, Entry]]:  # fmt: skip
    """mlx_lm.server's own prompt-cache entries for the served model, with their recency stamps
    (mlx-lm 0.32's LRUPromptCache keeps (model, tokens) per cache type in `_lru._lrus` and the
    entries in `_trie`). Tokens are cut to what the cache holds (a last sampled token was never
    fed to it); lossiness is recorded as the lookup rule sees it now."""
    listed = []
    for cache_type, lru in prompt_cache._lru._lrus.items():
        for model, tokens in list(lru):
            if model != model_key:
                continue
            cache = prompt_cache._trie.get(model, tokens).prompt_cache
            offsets = {getattr(layer, "offset", None) for layer in cache}
            held = offsets.pop() if len(offsets) == 1 else None
            if not isinstance(held, int) or held > len(tokens) or held < 1:
                continue
            ids = list(tokens[:held])
            lossy = (
                is_lossy(cache)
                or manager.lossy_floor(BUNDLE_KEY, ids) > 0
                or snapshots.lossy_floor(ids) > 0
            )
            source = f"mlx_lm.server prompt cache ({cache_type})"
            stamp = prompt_cache.stamps.get(tuple(tokens), 0)
            listed.append((stamp, Entry(ids, cache, source, lossy, continued_from(ids, bundles))))
    return listed


def continued_from(ids: list[int], bundles: list[Any]) -> str | None:
    """NAME@VERSION of the longest mounted bundle whose tokens open `ids`."""
    heads = [b for b in bundles if len(b.tokens) <= len(ids) and ids[: len(b.tokens)] == b.tokens]
    return max(heads, key=lambda b: len(b.tokens)).name if heads else None


class GenerationDeath:
    """Ends the process when mlx_lm.server's generation thread dies, so a service manager restarts
    it: the server would otherwise stay up answering every request with an error."""

    def __init__(self, grace_s: float = 10.0) -> None:
        """`grace_s`: how long the main thread may take to shut down before a hard exit."""
        self.cause: str | None = None
        self.grace_s = grace_s

    def report(self, cause: str) -> None:
        """Log the cause, then interrupt the main thread (mlx_lm.server stops its HTTP server and
        serve raises), with a hard exit after the grace period should it not get there; at once
        when SIGINT is ignored (a background job of a script), which interrupt_main cannot pass."""
        if self.cause is not None:
            return
        self.cause = cause
        log.error("generation thread died (%s); serve exits with status 1", cause)
        if not callable(signal.getsignal(signal.SIGINT)):
            hard_exit()
        timer = threading.Timer(self.grace_s, hard_exit)
        timer.daemon = True
        timer.start()
        _thread.interrupt_main()

    def error(self) -> PipelineError:
        """The error serve raises once the HTTP server has stopped."""
        return PipelineError(
            f"mlx_lm.server's generation thread died ({self.cause}); serve stopped so that a "
            "service manager restarts it"
        )


def guarded_response_generator_class(death: GenerationDeath) -> type:
    """mlx_lm.server's ResponseGenerator, reporting its generation thread's end to `death` and
    telling the prompt cache which path (single or batched) is fetching."""
    from mlx_lm.server import ResponseGenerator

    class GuardedResponseGenerator(ResponseGenerator):
        def _generate(self) -> None:  # the thread's target (0.30, 0.31) or what it calls (0.32)
            try:
                super()._generate()
            except BaseException as exc:  # noqa: BLE001 - any end of this thread ends serve
                log.debug("generation thread traceback", exc_info=True)
                self._generation_failed = True
                death.report(describe(exc))
                return
            if not self._stop:
                self._generation_failed = True
                death.report("it returned while serving")

        def generate(self, request: Any, generation_args: Any, *args: Any, **kwargs: Any) -> Any:
            # mlx_lm checks these only inside the generation thread, where one bad request would
            # end the thread (and so serve) for everyone: refuse it here, for this request only.
            problem = sampling_problem(generation_args, self.model_provider)
            if problem is not None:
                log.warning("request refused: %s", problem)
                raise ValueError(problem)
            return super().generate(request, generation_args, *args, **kwargs)

        def _serve_single(self, *args: Any, **kwargs: Any) -> Any:
            self.prompt_cache.single_path = True
            try:
                return super()._serve_single(*args, **kwargs)
            finally:
                self.prompt_cache.single_path = False

    return GuardedResponseGenerator


def sampling_problem(generation_args: Any, provider: Any) -> str | None:
    """Why mlx_lm's sampler would raise on a request's settings (it only checks them while
    sampling, in the generation thread), or None. Greedy requests build no sampler."""
    sampling = getattr(generation_args, "sampling", None)
    if sampling is None or not sampling.temperature > 0:
        return None
    model_args = getattr(getattr(provider, "model", None), "args", None)
    vocab = getattr(model_args, "vocab_size", None)
    top_k = sampling.top_k
    if top_k > 0 and isinstance(vocab, int) and top_k >= vocab:
        return f"top_k must be below the model's vocabulary size {vocab}, got {top_k}"
    threshold = sampling.xtc_threshold
    if sampling.xtc_probability > 0 and not 0 <= threshold <= 0.5:
        return f"xtc_threshold must be in [0, 0.5] when xtc_probability > 0, got {threshold}"
    return None


def warming_model_provider_class(
    manager: PromptCacheManager, enabled: bool, ready: threading.Event
) -> type:
    """mlx_lm.server's ModelProvider, warming up from the longest mounted bundle once the default model
    is loaded (in the generation thread, before it takes the first request); `ready` is set
    after, warm-up or not (the port opens then: open_port_when_ready)."""
    from mlx_lm.server import ModelProvider

    class WarmingModelProvider(ModelProvider):
        warmed = False

        def load_default(self) -> None:
            try:
                super().load_default()
                self._warm_up()
            finally:
                ready.set()

        def _warm_up(self) -> None:
            if not enabled or self.warmed or self.model is None:
                return
            self.warmed = True
            start = time.perf_counter()
            try:
                source = manager.warm_up(BUNDLE_KEY, self.model)
            except Exception as exc:  # optional: a failed warm-up must not stop the server
                log.warning("warm-up failed (%s); serving without it", describe(exc))
                return
            if source is not None:
                log.info(
                    "warmed up from %s in %.1f ms (the first request now costs what an "
                    "in-memory hit costs; --no-warm-up skips it)",
                    source.removeprefix("bundle:"),
                    (time.perf_counter() - start) * 1000,
                )

    return WarmingModelProvider


def open_port_when_ready(server: Any, ready: threading.Event, death: GenerationDeath) -> None:
    """mlx_lm.server opens its port at once while its generation thread loads the model: a
    load balancer probing /health would send traffic before the warm-up. The port opens once the
    model is loaded and warmed up (`ready`), or not at all when the thread died first."""
    original = server._run_http_server

    def run_http_server(host: str, port: int, *args: Any, **kwargs: Any) -> Any:
        while not ready.wait(0.1):
            if death.cause is not None:
                return None  # run() raises death.error()
        log.info("%s", try_it(host, port))
        return original(host, port, *args, **kwargs)

    server._run_http_server = run_http_server


def try_it(host: str, port: int) -> str:
    """The line that says where clients go and how to try it (the model field may be left out:
    mlx_lm.server answers with the model given to serve)."""
    where = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    body = '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}'
    return (
        f'ready: POST http://{where}:{port}/v1/chat/completions ("model" may be left out); '
        f"try: curl -s http://{where}:{port}/v1/chat/completions -H 'Content-Type: "
        f"application/json' -d '{body}'"
    )


def unusable_reason(bundle: MountedBundle, rest: list[str]) -> str | None:
    """Why mlx_lm.server, run with these options, would never use (or would misuse) a valid
    bundle; None when it will use it as built."""
    for option, what in (("--adapter-path", "an adapter"), ("--draft-model", "a draft model")):
        if passed_option(rest, option):
            return (
                f"{option} serves the model with {what}, whose prompt cache differs from the "
                "bundle's (mlx_lm.server keys its cache by model, adapter and draft model)"
            )
    bits, built = passed_option(rest, "--kv-bits"), bundle.manifest.cache.kv_bits
    if bits is not None and built is not None and str(built) != bits:
        return (
            f"--kv-bits {bits} asks for {bits}-bit KV but the bundle holds {built}-bit KV, which "
            "mlx_lm would continue as it is (it never re-quantizes a quantized cache); build it "
            f"with kv_bits = {bits}, or without kv_bits so the server quantizes it"
        )
    return None


def run(args: argparse.Namespace, rest: list[str], argv: list[str]) -> int:
    """Mount, install the hook, then hand over to mlx_lm.server's own main."""
    mounted = start(args, rest, argv, unusable=lambda b: unusable_reason(b, rest))
    check_tokenization("mlx-lm", mounted)
    manager = mounted.manager
    snapshots = start_snapshots(args, rest, mounted)

    import mlx_lm.server as server

    death, ready = GenerationDeath(), threading.Event()
    cache_class = bundled_prompt_cache_class(manager, args.model, snapshots)
    server.LRUPromptCache = cache_class
    # default on (bench case servers: first request / hit 1.35x without, 0.92x with)
    server.ModelProvider = warming_model_provider_class(manager, args.warm_up is not False, ready)
    open_port_when_ready(server, ready, death)
    server.ResponseGenerator = guarded_response_generator_class(death)
    server.scan_cache_dir = hub_cache_or_none(server.scan_cache_dir)
    sys.argv = ["mlx_lm.server", "--model", args.model, *rest]
    try:
        server.main()
    except KeyboardInterrupt:
        if death.cause is None:
            raise
    if death.cause is not None:
        raise death.error()
    if snapshots is not None and cache_class.instances:  # a graceful stop: the server has joined
        listed = listed_entries(
            cache_class.instances[0], (args.model, None, None), manager, snapshots,
            mounted.result.bundles,
        )  # fmt: skip
        snapshots.save(listed, lambda ids: manager.covered(BUNDLE_KEY, ids))
    return 0


def start_snapshots(args: argparse.Namespace, rest: list[str], mounted: Any) -> Snapshots | None:
    """With --snapshots: lock the folder, restore its newest set after the bundles, and make
    SIGTERM stop the server gracefully (as SIGINT does) so that the entries are saved."""
    if getattr(args, "snapshots", None) is None:
        return None
    if passed_option(rest, "--adapter-path") or passed_option(rest, "--draft-model"):
        raise PipelineError(
            "--snapshots with --adapter-path or --draft-model: the server's entries then belong "
            "to a model the snapshots do not record; serve without one of them"
        )
    budget = parse_size(getattr(args, "snapshot_budget", None) or "2GiB")
    template = passed_option(rest, "--chat-template")
    snapshots = Snapshots(args.snapshots, budget, args.model, template, "mlx-lm")
    snapshots.restore([b.tokens for b in mounted.result.bundles])
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
    return snapshots


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM as SIGINT: mlx_lm.server stops its HTTP server and joins its generation thread.
    A second SIGTERM (a supervisor and its wrapper both sending one) is ignored, so it cannot cut
    the stop short; SIGKILL still can (the previous snapshot set then stays)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    log.info("SIGTERM: stopping, then saving snapshots (SIGKILL keeps the previous set)")
    raise KeyboardInterrupt
