"""mlx_lm.server's generation thread under serve: mlx-lm-only code, installed by the mlx-lm hook
(mlx_lm.py).

mlx_lm.server loads its model on that thread and serves every request from it, while its port
opens at once. Under serve the model is loaded and warmed up there before the port opens (a load
balancer probing /health sends no traffic to a cold server), a request whose sampling settings
would kill the thread is refused alone, and the thread's death ends the process (the server would
otherwise stay up answering every request with an error) so that a service manager restarts it.
"""

from __future__ import annotations

import _thread
import logging
import signal
import threading
from typing import Any

from pipeline.format.errors import PipelineError
from pipeline.runtime.servers import warm_up
from pipeline.runtime.servers.mounted import Mounted
from pipeline.runtime.servers.startup import describe, hard_exit

log = logging.getLogger("prefix-bundles")


def install(server: Any, mounted: Mounted) -> tuple[GenerationDeath, type]:
    """Replace mlx_lm.server's ModelProvider (warm-up from `mounted`, then the port opens) and
    ResponseGenerator (refusals, its death reported); returns the death and the provider class
    (its `enabled` is serve's --warm-up)."""
    death, ready = GenerationDeath(), threading.Event()
    server.ModelProvider = provider = warming_model_provider_class(mounted, ready)
    open_port_when_ready(server, ready, death)
    server.ResponseGenerator = guarded_response_generator_class(death)
    return death, provider


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
