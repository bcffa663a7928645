"""`serve`: mlx_lm.server with bundles mounted before the first request is accepted.

Errors are raised (PipelineError); the CLI (pipeline.cli.serve) parses options and prints.

The hook replaces three names in mlx_lm.server before its main() runs: `LRUPromptCache` (a
subclass that answers from the mounted bundles when they cover more of the prompt than the
server's own entries, and hands the batched path only caches it can merge), `ModelProvider`
(optional warm-up) and `ResponseGenerator` (a dead generation thread ends the process; the prompt
cache is told which path fetches). Everything else (options, HTTP, generation) is mlx_lm.server's.
"""

from __future__ import annotations

import _thread
import argparse
import datetime
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pipeline.format.compat import SUPPORTED_RANGE, installed_mlx_lm, mlx_lm_supported
from pipeline.format.errors import PipelineError
from pipeline.format.lockfile import locked_versions
from pipeline.format.signature import read_trusted_keys
from pipeline.runtime.lookup import lookup
from pipeline.runtime.mount import MountedBundle, MountResult, mount
from pipeline.runtime.prompt_cache import PromptCacheManager, at_least_one_left
from pipeline.runtime.remount import Remounter

log = logging.getLogger("prefix-bundles")
BUNDLE_KEY = "bundles"
SERVER = "mlx_lm.server"


def check_mlx_lm() -> str:
    """The installed mlx-lm version, or a PipelineError when serve does not support it."""
    version = installed_mlx_lm()
    if not mlx_lm_supported(version):
        raise PipelineError(
            f"serve supports mlx-lm {SUPPORTED_RANGE}; found {version}: "
            f"install one with \"pip install 'mlx-lm{SUPPORTED_RANGE}'\""
        )
    return version


def bundled_prompt_cache_class(manager: PromptCacheManager, model_path: str) -> type:
    """A LRUPromptCache subclass that also answers from the bundles pinned in `manager`, and hands
    the batched path only caches it can merge (see pipeline.runtime.batching)."""
    from mlx_lm.server import LRUPromptCache

    class BundledPromptCache(LRUPromptCache):
        single_path = False  # True while the ResponseGenerator serves a request on its own

        def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[Any, list[int]]:
            own = super().fetch_nearest_cache
            if model != (model_path, None, None) or not tokens:
                return at_least_one_left(lambda t: own(model, t), tokens)
            return lookup(
                SERVER, manager, BUNDLE_KEY, tokens, lambda t: own(model, t), not self.single_path
            )

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


def hard_exit() -> None:
    """Exit with status 1 now, from any thread, output flushed."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(1)


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
                death.report(_describe(exc))
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


def _describe(exc: BaseException) -> str:
    """`Type: message at file:line` of the innermost frame, on one line."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}{where}" if message else f"{type(exc).__name__}{where}"


def warming_model_provider_class(manager: PromptCacheManager, enabled: bool) -> type:
    """mlx_lm.server's ModelProvider, warming up from the longest mounted bundle once the default model
    is loaded (in the generation thread, before it takes the first request)."""
    from mlx_lm.server import ModelProvider

    class WarmingModelProvider(ModelProvider):
        warmed = False

        def load_default(self) -> None:
            super().load_default()
            if not enabled or self.warmed or self.model is None:
                return
            self.warmed = True
            start = time.perf_counter()
            try:
                source = manager.warm_up(BUNDLE_KEY, self.model)
            except Exception as exc:  # optional: a failed warm-up must not stop the server
                log.warning("warm-up failed (%s); serving without it", _describe(exc))
                return
            if source is not None:
                log.info(
                    "warmed up from %s in %.1f ms (the first request now costs what an "
                    "in-memory hit costs; --no-warm-up skips it)",
                    source.removeprefix("bundle:"),
                    (time.perf_counter() - start) * 1000,
                )

    return WarmingModelProvider


def log_mounts(result: MountResult) -> None:
    """One line per bundle mounted or refused, and the total."""
    today = datetime.date.today()
    for warning in filter(None, (b.date_warning(today) for b in result.bundles)):
        log.warning("%s", warning)
    for b in result.bundles:
        log.info(
            "mounted %s (%d tokens, %.1f MiB, continues at %s) from %s in %.1f ms",
            b.name,
            len(b.tokens),
            b.manifest.cache.nbytes / 2**20,
            b.precision,
            b.path,
            b.seconds * 1000,
        )
    for r in result.refused:
        log.warning("refused %s: %s", r.path, r.reason)
    for path, reason in result.unused:
        log.warning("not used: %s: %s", path, reason)
    for path in result.older:
        log.info("not mounted: older version %s", path)
    log.info(
        "%d bundle(s) mounted, %d refused, %d not usable with the server's options, %d older "
        "version(s) not mounted, in %.1f ms",
        len(result.bundles),
        len(result.refused),
        len(result.unused),
        len(result.older),
        result.seconds * 1000,
    )


# where each server binds when its options do not say (read from the released packages)
DEFAULT_ADDRESS = {
    "mlx-lm": ("127.0.0.1", 8080),
    "vllm-mlx": ("127.0.0.1", 8000),
    "mlx-openai-server": ("0.0.0.0", 8000),
    "mlx-omni-server": ("0.0.0.0", 10240),
    "rapid-mlx": ("127.0.0.1", 8000),
}


def port_number(option: str, text: object) -> int:
    """A TCP port a server can listen on and log as given: 1-65535 (0 would be a random port
    nobody is told; larger numbers wrap around in some servers' bind)."""
    try:
        port = int(str(text))
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise PipelineError(
            f"{option} {str(text)[:40]!r} is not a port number; pass {option} N with N in "
            "1-65535 (nothing was loaded or mounted)"
        )
    return port


def check_admin(args: argparse.Namespace) -> None:
    """The admin endpoint's options, before anything is loaded: its port in range and free,
    its token file readable."""
    from pipeline.runtime.admin import HOST, read_token

    if getattr(args, "admin_token_file", None) is not None:
        if getattr(args, "admin_port", None) is None:
            raise PipelineError("--admin-token-file needs --admin-port N (the endpoint it guards)")
        read_token(args.admin_token_file)
    if getattr(args, "admin_port", None) is None:
        return
    import socket

    port = port_number("--admin-port", args.admin_port)
    try:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((HOST, port))
    except OSError as exc:
        raise PipelineError(
            f"--admin-port {port}: cannot listen on {HOST}:{port} ({exc.strerror}); pass another "
            "port (nothing was loaded or mounted)"
        ) from None


def check_port(server: str, rest: list[str]) -> None:
    """PipelineError when the server's address cannot be bound, before any model is loaded or
    bundle mounted: a taken port then costs nothing and never leaves a second process behind."""
    import socket

    host, port = DEFAULT_ADDRESS[server]
    host = passed_option(rest, "--host") or host
    text = passed_option(rest, "--port")
    port = port_number("--port", text) if text is not None else port
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
            probe.bind(address)
    except (OSError, IndexError, OverflowError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        raise PipelineError(
            f"cannot listen on {host}:{port} ({why}); stop the process using it or pass "
            "another --port (nothing was loaded or mounted)"
        ) from None


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


def drop_unusable(
    result: MountResult, manager: PromptCacheManager, why: Callable[[MountedBundle], str | None]
) -> None:
    """Move every bundle the server would not use (`why` says why, else None) from
    `result.bundles` to `result.unused` (unpinned): the startup report counts only usable ones."""
    for b in list(result.bundles):
        reason = why(b)
        if reason is not None:
            result.bundles.remove(b)
            result.unused.append((b.path, reason))
            manager.unpin(BUNDLE_KEY, b.name)


def hub_cache_or_none(scan: Callable[[], Any]) -> Callable[[], Any]:
    """mlx_lm.server's /v1/models scans the hub cache before listing the served model; on a host
    with no hub cache folder the scan raises CacheNotFound after the status line went out (an empty
    200 body). With this, a missing cache is an empty one and the served model is listed."""
    from huggingface_hub.errors import CacheNotFound

    def scan_cache_dir() -> Any:
        try:
            return scan()
        except CacheNotFound:
            return SimpleNamespace(repos=[])

    return scan_cache_dir


def mount_options(args: argparse.Namespace, chat_template: str | None) -> Callable[[], dict]:
    """mount's options from serve's own, read afresh on each call (a remount re-reads the
    lockfile a deploy may have updated)."""

    def options() -> dict:
        return {
            "chat_template": chat_template,
            "verify_full": args.verify_full,
            "versions": locked_versions(args.lockfile) if args.lockfile else None,
            "trusted_keys": read_trusted_keys(getattr(args, "trusted_key", None) or []),
        }

    return options


def live_remount(
    args: argparse.Namespace,
    result: MountResult,
    manager: PromptCacheManager,
    options: Callable[[], dict],
    unusable: Callable[[MountedBundle], str | None],
) -> None:
    """A new bundle version goes live without a restart: SIGHUP re-reads the bundles (`kill
    -HUP <pid>` after a deploy) with startup's rules and options, in a thread of its own so the
    server goes on answering, one log line per change, a failure logged and never fatal (only
    the main thread can install the handler); with --admin-port, POST /v1/bundles/remount on
    the loopback interface does the same and answers with a JSON report (pipeline.runtime.admin)."""
    from pipeline.runtime.admin import read_token, start_admin

    def reload() -> MountResult:
        return mount(args.model, args.bundles, skip_refused=True, **options())

    remounter = Remounter(result, manager, BUNDLE_KEY, reload, unusable)
    if getattr(args, "admin_port", None) is not None:
        start_admin(args.admin_port, read_token(getattr(args, "admin_token_file", None)), remounter)

    def run() -> None:
        try:
            remounter.remount().log(log)
        except Exception as exc:  # noqa: BLE001 - a failed remount leaves what was mounted
            log.error("remount failed (%s); the mounted bundles stay", _describe(exc))

    def on_hangup(signum: int, frame: Any) -> None:
        threading.Thread(target=run, name="prefix-bundles-remount", daemon=True).start()

    if hasattr(signal, "SIGHUP") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGHUP, on_hangup)


def passed_option(rest: list[str], name: str) -> str | None:
    """The value of a server option passed through (`--name V` or `--name=V`), if any."""
    for i, arg in enumerate(rest):
        if arg == name and i + 1 < len(rest):
            return rest[i + 1] or None
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1] or None
    return None


def serve(args: argparse.Namespace, rest: list[str], argv: list[str]) -> int:
    """Mount, install the hook, then hand over to mlx_lm.server's own main.

    `args` holds serve's own options (pipeline.cli.serve), `rest` the server's, `argv` the whole
    command line (to re-execute it for huge pages).
    """
    check_port(getattr(args, "server", "mlx-lm"), rest)
    check_admin(args)
    if getattr(args, "server", "mlx-lm") != "mlx-lm":
        from pipeline.runtime import servers

        return servers.run(args.server, args, rest, argv)
    from pipeline.runtime.servers.startup import check_tokenization, start

    mounted = start(args, rest, argv, unusable=lambda b: unusable_reason(b, rest))
    check_tokenization("mlx-lm", mounted)
    manager = mounted.manager

    import mlx_lm.server as server

    death = GenerationDeath()
    server.LRUPromptCache = bundled_prompt_cache_class(manager, args.model)
    # default on (bench case servers: first request / hit 1.35x without, 0.92x with)
    server.ModelProvider = warming_model_provider_class(manager, args.warm_up is not False)
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
    return 0
