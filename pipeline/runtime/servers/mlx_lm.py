"""`serve` (the default server): mlx_lm.server with bundles mounted before the first request is
accepted.

The hook replaces names in mlx_lm.server before its main() runs: `LRUPromptCache` (a subclass
answering from the mounted bundles and restored snapshots under the one lookup rule, handing the
batched path only caches it can merge), `ModelProvider` (warm-up, then the port opens) and
`ResponseGenerator` (a dead generation thread ends the process; a request whose sampling settings
would kill that thread is refused alone; the prompt cache is told which path fetches).
Everything else (options, HTTP, generation) is mlx_lm.server's.
"""

from __future__ import annotations

import _thread
import logging
import signal
import sys
import threading
from types import SimpleNamespace
from typing import Any

from pipeline.format.errors import PipelineError
from pipeline.runtime.prompt_cache import at_least_one_left
from pipeline.runtime.servers import warm_up
from pipeline.runtime.servers.hook import ServerHook
from pipeline.runtime.servers.lru_cache import lru_entries, pinned_lru_class
from pipeline.runtime.servers.mounted import Mounted
from pipeline.runtime.servers.options import ServeOptions
from pipeline.runtime.servers.startup import describe, hard_exit, hub_cache_or_none
from pipeline.runtime.snapshots import Snapshots

log = logging.getLogger("prefix-bundles")
SERVER = "mlx_lm.server"


class Hook(ServerHook):
    name, package, address, snapshots = "mlx-lm", "mlx_lm.server", ("127.0.0.1", 8080), True
    periodic_snapshots = True  # its generation thread alone stores entries (tested, real server)

    def refused(self, options: ServeOptions) -> dict[str, str]:
        if options.snapshots is None:
            return {}
        why = "the server's entries then belong to a model the snapshots do not record"
        return {
            "--adapter-path": f"with --snapshots: {why}",
            "--draft-model": f"with --snapshots: {why}",
        }

    def unusable(self, bundle: Any, options: ServeOptions) -> str | None:
        for option, what in (("--adapter-path", "an adapter"), ("--draft-model", "a draft model")):
            if options.passed(option):
                return (
                    f"{option} serves the model with {what}, whose prompt cache differs from the "
                    "bundle's (mlx_lm.server keys its cache by model, adapter and draft model)"
                )
        bits, built = options.passed("--kv-bits"), bundle.manifest.cache.kv_bits
        if bits is not None and built is not None and str(built) != bits:
            return (
                f"--kv-bits {bits} asks for {bits}-bit KV but the bundle holds {built}-bit KV, which "
                "mlx_lm would continue as it is (it never re-quantizes a quantized cache); build it "
                f"with kv_bits = {bits}, or without kv_bits so the server quantizes it"
            )
        return None

    @staticmethod
    def request_ids(tokenizer: Any, body: dict[str, Any], model_type: str) -> list[int]:
        from mlx_lm.server import ResponseGenerator  # its _tokenize, on stand-ins

        cli = SimpleNamespace(chat_template_args={})
        generator = SimpleNamespace(model_provider=SimpleNamespace(cli_args=cli, processor=None))
        request = SimpleNamespace(
            request_type="chat", messages=body["messages"], tools=body.get("tools"),
            role_mapping=body.get("role_mapping"),
        )  # fmt: skip
        args = SimpleNamespace(chat_template_kwargs=body.get("chat_template_kwargs"))
        return ResponseGenerator._tokenize(generator, tokenizer, request, args)[0]

    @staticmethod
    def encode_text(tokenizer: Any, text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    def install(self, mounted: Mounted, options: ServeOptions, snapshots: Any = None) -> None:
        import mlx_lm.server as server

        self.death, self.ready = GenerationDeath(), threading.Event()
        self.cache_class = bundled_prompt_cache_class(mounted, str(options.model), snapshots)
        server.LRUPromptCache = self.cache_class
        self.provider = warming_model_provider_class(mounted, self.ready)
        server.ModelProvider = self.provider
        open_port_when_ready(server, self.ready, self.death)
        server.ResponseGenerator = guarded_response_generator_class(self.death)
        server.scan_cache_dir = hub_cache_or_none(server.scan_cache_dir)

    def warm_up_server(self, mounted: Mounted, options: ServeOptions) -> None:
        # measured (bench case servers): first request / hit 1.35x without, 0.92x with
        self.provider.enabled = True

    def launch(self, mounted: Mounted, options: ServeOptions) -> int:
        import mlx_lm.server as server

        sys.argv = ["mlx_lm.server", "--model", str(options.model), *options.rest]
        try:
            server.main()
        except KeyboardInterrupt:
            if self.death.cause is None:
                raise
        if self.death.cause is not None:
            raise self.death.error()
        return 0

    def entries(self, mounted: Mounted, snapshots: Snapshots) -> list[Any]:
        if not self.cache_class.instances:
            return []
        key = (str(mounted.model), None, None)  # mlx_lm.server's key: (model, adapter, draft)
        return lru_entries(self.cache_class.instances[0], key, mounted, snapshots, SERVER)


def bundled_prompt_cache_class(mounted: Mounted, model_path: str, snapshots: Any = None) -> type:
    """mlx_lm.server's LRUPromptCache, also answering from the bundles pinned in `mounted` (and
    the restored `snapshots`); the batched path gets only caches it can merge."""
    from mlx_lm.server import LRUPromptCache

    class BundledPromptCache(pinned_lru_class(LRUPromptCache, mounted, snapshots, SERVER)):
        single_path = False  # True while the ResponseGenerator serves a request on its own

        def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[Any, list[int]]:
            fetch = lambda t: super(BundledPromptCache, self).fetch_nearest_cache(model, t)  # noqa: E731
            if model != (model_path, None, None) or not tokens:
                return at_least_one_left(fetch, tokens)
            return self.answer(tokens, fetch, batched=not self.single_path, key=model)[:2]

        def insert_cache(self, model: Any, tokens: list[int], *args: Any, **kwargs: Any) -> None:
            super().insert_cache(model, tokens, *args, **kwargs)
            self.stamped(tokens, args[0] if args else kwargs.get("prompt_cache"))

    return BundledPromptCache


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
    sampling, in the generation thread), or None. Greedy requests build no sampler; a logit bias
    applies to them too (MLX's scatter past the vocabulary crashes the whole process)."""
    model_args = getattr(getattr(provider, "model", None), "args", None)
    vocab = getattr(model_args, "vocab_size", None)
    bias = getattr(getattr(generation_args, "logits", None), "logit_bias", None) or {}
    outside = sorted(k for k in bias if isinstance(vocab, int) and not 0 <= k < vocab)
    if outside:
        return f"logit_bias token ids must be in [0, {vocab}) (the vocabulary), got {outside[0]}"
    sampling = getattr(generation_args, "sampling", None)
    if sampling is None or not sampling.temperature > 0:
        return None
    top_k = sampling.top_k
    if top_k > 0 and isinstance(vocab, int) and top_k >= vocab:
        return f"top_k must be below the model's vocabulary size {vocab}, got {top_k}"
    threshold = sampling.xtc_threshold
    if sampling.xtc_probability > 0 and not 0 <= threshold <= 0.5:
        return f"xtc_threshold must be in [0, 0.5] when xtc_probability > 0, got {threshold}"
    return None


def warming_model_provider_class(mounted: Mounted, ready: threading.Event) -> type:
    """mlx_lm.server's ModelProvider, warming up (when `enabled`) from the longest mounted bundle
    once the default model is loaded (in the generation thread, before it takes the first
    request); `ready` is set after, warm-up or not (the port opens then: open_port_when_ready)."""
    from mlx_lm.server import ModelProvider

    class WarmingModelProvider(ModelProvider):
        enabled = False  # serve's --warm-up (Hook.warm_up_server)
        warmed = False

        def load_default(self) -> None:
            try:
                super().load_default()
                self._warm_up()
            finally:
                ready.set()

        def _warm_up(self) -> None:
            if self.enabled and not self.warmed and self.model is not None:
                self.warmed = True
                warm_up.through_model(mounted, self.model)

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
        where = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        log.info("ready: POST http://%s:%s/v1/chat/completions (port open)", where, port)
        return original(host, port, *args, **kwargs)

    server._run_http_server = run_http_server
