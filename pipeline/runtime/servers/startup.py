"""The start-up every wrapped server shares, in one function (`serve`), and its steps: logging,
huge pages, mount and validate, drop what the server's options cannot use, log it, live remount
(SIGHUP, --admin-port), the tokenization check, snapshots, install, warm-up, the server's run.

The bundles are validated by the one validator (pipeline.runtime.mount) and pinned into a
PromptCacheManager; the server's hook (pipeline.runtime.servers.hook) then hands that manager's
caches to the server's own prompt cache. Nothing here imports a server or a hook.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pipeline.format.compat import SUPPORTED_RANGE, installed_mlx_lm, mlx_lm_supported
from pipeline.format.errors import PipelineError
from pipeline.format.fingerprint import ModelIdentity, folder_state
from pipeline.format.lockfile import locked_folders, locked_for_model, locked_versions
from pipeline.format.served_identity import changed_message, settled_identity
from pipeline.format.signature import read_trusted_keys
from pipeline.runtime.hugepages import ensure_huge_pages
from pipeline.runtime.lookup import log_request
from pipeline.runtime.mount import MountedBundle, MountResult, mount
from pipeline.runtime.prompt_cache import PromptCacheManager
from pipeline.runtime.remount import Remounter
from pipeline.runtime.servers.hook import ServerHook
from pipeline.runtime.servers.mounted import BUNDLE_KEY, Mounted
from pipeline.runtime.servers.options import (
    ServeOptions,
    check_admin,
    check_port,
    passed_option,
    refuse_options,
    require,
)
from pipeline.runtime.servers.tokens import model_type, request_parity
from pipeline.runtime.snapshot_store import private_folder

log = logging.getLogger("prefix-bundles")
__all__ = [
    "describe",
    "hard_exit",
    "hub_cache_or_none",
    "log_request",
    "mount_for",
    "passed_option",
    "serve",
]


def serve(hook: ServerHook, options: ServeOptions) -> int:
    """Everything serve runs in a wrapped server's process, in order. Options are checked before
    anything is loaded; a bundle is mounted only through the one validator; the hook only
    installs its cache subclass, arranges the warm-up, and starts its server."""
    if options.snapshots is not None and not hook.snapshots:
        raise PipelineError(
            f"--snapshots is not supported with --server {hook.name} yet (docs/snapshots.md "
            "lists the servers that support it); serve without --snapshots"
        )
    with hangups_held(hook.live):
        every = getattr(options, "snapshot_every", None)  # parsed and checked with the options
        if options.snapshots is not None and os.path.lexists(options.snapshots):
            private_folder(options.snapshots, create=False)  # before anything loads (created later)
        require(hook.package, hook.name)
        refuse_options(list(options.rest), hook.name, hook.refused(options))
        check_port(hook.address, list(options.rest))
        check_admin(options)
        setup_logging(options.passed("--log-level"))
        ensure_huge_pages(options.huge_pages, list(options.argv))
        template = hook.chat_template(options)
        mounted = mount_for(options, template, lambda b: hook.unusable(b, options), hook.live)
        check_tokenization(hook, mounted)
        # said after the warm-up, counted before `install` (a hook whose model process serves the
        # bundles unpins them here)
        tried = try_it(hook, options, mounted)
        # a hook whose model process serves the mount (not `live`) opens its snapshots there
        snapshots = (
            open_snapshots(hook, options, mounted) if options.snapshots and hook.live else None
        )
        hook.install(mounted, options, snapshots)
        if options.warm_up:
            hook.warm_up_server(mounted, options)
        else:
            why = (
                "--no-warm-up"
                if hook.warm_up
                else f"off by default for {hook.name}; --warm-up runs it"
            )
            log.info("no warm-up (%s)", why)
        log.info("%s", tried)
        if mounted.result.bundles:
            log.info("%s", reuse_hint(mounted, options))
        if hook.live:  # from here the process ends without the interpreter teardown (cli.serve)
            SERVED.set()
        if snapshots is None:
            return launched(hook, mounted, options, saving=False)
        if every:  # spilled while serving: captured where the hook stores, written off its thread
            listing = lambda: listed(hook, mounted, snapshots)  # noqa: E731
            snapshots.spill_while_serving(every, listing, mounted.covered)
        try:
            code = launched(hook, mounted, options, saving=True)
        except KeyboardInterrupt:  # SIGTERM/SIGINT as re-raised by uvicorn after its graceful stop
            code = 0
        snapshots.stop_saving()  # a spill under way ends first; none starts after
        if mounted.loaded_as_fingerprinted():  # else what the server ran is unknown: nothing saved
            snapshots.save(hook.entries(mounted, snapshots), mounted.covered)  # the server stopped
        return code


def launched(hook: ServerHook, mounted: Mounted, options: ServeOptions, saving: bool) -> int:
    """The server's own command line until it stops; a Ctrl-C (SIGINT) is said as it comes (a
    stop that saves snapshots read as a hang), then handled as the server handles it (servers
    that install their own handler, as uvicorn does, say it themselves)."""
    said = "SIGINT: stopping" + ("; saving the snapshots" if saving else "")

    def interrupted(signum: int, frame: Any) -> None:
        log.info("%s", said)
        signal.default_int_handler(signum, frame)

    main = threading.current_thread() is threading.main_thread()
    if main and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, interrupted)  # not where SIGINT is ignored (a background job)
    return hook.launch(mounted, options)


EARLY_HANGUP = threading.Event()  # a SIGHUP came before live remount could take it
# the server ran in this process: its threads (MLX's among them) can abort the interpreter's
# teardown (SIGABRT, "terminate called without an active exception"; plain mlx_lm.server too),
# so the CLI ends such a process with os._exit once everything is written
SERVED = threading.Event()


@contextlib.contextmanager
def hangups_held(live: bool) -> Iterator[None]:
    """SIGHUP never kills serve (its default action): from the first step a SIGHUP is noted
    (`live_remount` then remounts once: a deploy's reload during a restart is not lost), and
    after the server stopped it is ignored (Python restores the default while it exits)."""
    if not (live and hasattr(signal, "SIGHUP")):
        yield
        return
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGHUP, lambda signum, frame: EARLY_HANGUP.set())
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGHUP, signal.SIG_IGN)


def listed(hook: ServerHook, mounted: Mounted, snapshots: Any) -> list[Any]:
    """The entries a periodic save writes; PipelineError (the save is skipped, the previous set
    stays) when what the server loaded is unknown (Mounted.loaded_as_fingerprinted)."""
    if not mounted.loaded_as_fingerprinted():
        raise PipelineError("the model folder changed under serve: nothing is saved")
    return hook.entries(mounted, snapshots)


def try_it(hook: ServerHook, options: ServeOptions, mounted: Mounted | None = None) -> str:
    """The line that says which model id clients send, where, and one curl to try it: with a
    bundle mounted that records its request, that request (servers/try_request.py), saying how
    many tokens the reuse rule takes from the bundle; else a one-turn "Hello"."""
    import json
    import shlex

    from pipeline.runtime.servers.try_request import try_request

    host = options.passed("--host") or hook.address[0]
    port = options.passed("--port") or hook.address[1]
    where = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    model = hook.clients_send(options)
    url = f"http://{where}:{port}/v1/chat/completions"
    said = f'{hook.name}: clients send "model": {json.dumps(model)} to {url}; once the port opens'
    curl = "curl -s {} -H 'Content-Type: application/json' -d {}"
    tried = None
    if mounted is not None:
        tried = try_request(hook, mounted, model, lambda: server_tokenizer(mounted))
    if tried is None:
        body = {"model": model, "messages": [{"role": "user", "content": "Hello"}]}
        data = shlex.quote(json.dumps({**body, "max_tokens": 16}))
        return f"{said}, try: {curl.format(url, data)}"
    return (
        f"{said}, try a request opening with {tried.bundle}'s prompt ({tried.taken:,} of its "
        f"{tried.total:,} tokens come from the bundle; usage reports them as cached tokens): "
        f"{tried.printer} | {curl.format(f'http://{where}:{port}{tried.route}', '@-')}"
    )


def reuse_hint(mounted: Mounted, options: ServeOptions) -> str:
    """What a request must open with to be served from a bundle (each mounted one by name and
    length: the try line shows one), and how to check a request of one's own."""
    named = ", ".join(f"{b.name} ({len(b.tokens):,} tokens)" for b in mounted.result.bundles)
    return (
        f"a request is served from a bundle when it opens with that bundle's prompt: {named}; "
        f"'prefix-bundles match --model {options.model} --prompt-file REQUEST.json' says how many "
        "tokens of a request come from which bundle, and each reply's usage reports them "
        "(cached_tokens)"
    )


def open_snapshots(hook: ServerHook, options: ServeOptions, mounted: Mounted) -> Any:
    """--snapshots: lock the folder, restore its newest set after the bundles."""
    from pipeline.runtime.snapshots import open_snapshots as open_folder

    return open_folder(options, mounted, hook)


def setup_logging(level: str | None) -> None:
    logging.basicConfig(
        level=getattr(logging, (level or "INFO").upper(), logging.INFO),
        format="%(asctime)s - %(levelname)s - %(message)s",
    )


def mount_for(
    options: ServeOptions,
    chat_template: str | None = None,
    unusable: Callable[[MountedBundle], str | None] | None = None,
    live: bool = True,
    stop: Callable[[], None] | None = None,
) -> Mounted:
    """Validate and mount the bundles for the model, drop those the server would not use
    (`unusable` says why), log them; PipelineError under --strict. `live`: this process serves
    from them, so SIGHUP and --admin-port re-mount them (live_remount); `stop`: the admin
    endpoint's graceful stop (default: this process's, `stop_serve`)."""
    check_mlx_lm()
    manager = PromptCacheManager(bundle_memory=options.bundle_memory)
    # the weights the server will load: every mount (remounts too) checks bundles against these
    identity, state = settled_identity(options.model, chat_template)
    read_options = mount_options(options, chat_template, identity.model)
    result = mount(
        options.model,
        options.bundles,
        skip_refused=not options.strict,
        manager=manager,
        model_key=BUNDLE_KEY,
        identity=identity,
        **read_options(),
    )
    if unusable is not None:
        drop_unusable(result, manager, unusable)
    from pipeline.runtime.mount import release_caches

    release_caches(result)  # the manager alone holds them: a shared preamble once
    log_mounts(result)
    held = manager.stats()
    if result.bundles:
        log.info(
            "bundles hold %.1f MiB in memory (%.1f MiB whole, a shared preamble counted once); "
            "%d wait on disk%s",
            held["held_bytes"] / 2**20, held["pinned_bytes"] / 2**20, held["on_disk"],
            "" if options.bundle_memory is None
            else f" (--bundle-memory {options.bundle_memory / 2**20:.1f} MiB)",
        )  # fmt: skip
    if options.strict and result.unused:
        path, reason = result.unused[0]
        raise PipelineError(f"--strict: bundle {path} would not be used: {reason}")
    if options.strict and not result.bundles:
        raise PipelineError(
            f"--strict: no bundle for {options.model} was found in {options.bundles}"
        )
    if live:
        served = (identity, state)
        unused = unusable or (lambda b: None)
        live_remount(options, result, manager, read_options, unused, served, stop or stop_serve)
    return Mounted(options.model, manager, result, chat_template, options.strict, state=state)


def check_tokenization(hook: ServerHook, mounted: Mounted) -> dict[str, int]:
    """Run each bundle's recorded request (its prefix and a user turn) through the server's own
    request code (or, for bundles without one, re-encode its text the server's way); one warning
    per bundle the server's first request will not reuse whole, PipelineError under --strict
    (`mounted.strict`).
    Returns {bundle name: tokens the server can reuse}, also kept as `mounted.reusable`."""
    tokenizer = server_tokenizer(mounted)
    kind = model_type(mounted.model)
    reusable = mounted.reusable
    for b in mounted.result.bundles:
        try:
            p = request_parity(hook.name, tokenizer, b, kind)
        except PipelineError as exc:  # the server refuses the recorded request (another API)
            p = None
            line = f"{b.name}: not checked against {hook.name}'s own request code: {exc}"
        if p is not None:
            reusable[b.name] = p.reusable
            if p.reason is None:
                continue
            line = f"{b.name}: requests will reuse at most {p.reusable} of its {p.total} tokens: {p.reason}"
        if mounted.strict:
            raise PipelineError(f"--strict: bundle {b.path}: {line}")
        log.warning("%s", line)
    return reusable


def server_tokenizer(mounted: Mounted) -> Any:
    """mlx-lm's tokenizer of the served model, with the template the server was given."""
    from mlx_lm.utils import load_tokenizer

    extra = {"chat_template": mounted.chat_template} if mounted.chat_template else None
    return load_tokenizer(mounted.model, tokenizer_config_extra=extra)


def check_mlx_lm() -> str:
    """The installed mlx-lm version, or a PipelineError when serve does not support it."""
    version = installed_mlx_lm()
    if not mlx_lm_supported(version):
        raise PipelineError(
            f"serve supports mlx-lm {SUPPORTED_RANGE}; found {version}: "
            f"install one with \"pip install 'mlx-lm{SUPPORTED_RANGE}'\""
        )
    return version


def mount_options(
    options: ServeOptions, chat_template: str | None, fingerprint: str
) -> Callable[[], dict]:
    """mount's options from serve's own, read afresh on each call (a remount re-reads the
    lockfile a deploy may have updated); what the lockfile pins for the served model
    (`fingerprint`) must be there."""

    def read() -> dict:
        lockfile = options.lockfile
        return {
            "chat_template": chat_template,
            "verify_full": options.verify_full,
            "versions": locked_versions(lockfile) if lockfile else None,
            "required": locked_for_model(lockfile, fingerprint) if lockfile else None,
            "folders": locked_folders(lockfile) if lockfile else None,  # the folders it names
            "trusted_keys": read_trusted_keys(list(options.trusted_keys)),
        }

    return read


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
        "version(s) not mounted, in %.1f ms (%.1f ms of it the one-time imports a load needs)",
        len(result.bundles),
        len(result.refused),
        len(result.unused),
        len(result.older),
        result.seconds * 1000,
        result.import_seconds * 1000,
    )


def live_remount(
    serve_options: ServeOptions,
    result: MountResult,
    manager: PromptCacheManager,
    options: Callable[[], dict],
    unusable: Callable[[MountedBundle], str | None],
    served: tuple[ModelIdentity, tuple[str, ...]],
    stop: Callable[[], None],
) -> None:
    """A new bundle version goes live without a restart: SIGHUP re-reads the bundles (`kill
    -HUP <pid>` after a deploy) with startup's rules and options, against the weights the server
    runs (`served`: its identity and folder state at startup), in a thread of its own so the
    server goes on answering, one log line per change, a failure logged and never fatal (only
    the main thread can install the handler); with --admin-port, POST /v1/bundles/remount on
    the loopback interface does the same and answers with a JSON report (pipeline.runtime.admin)."""
    from pipeline.runtime.admin import read_token, start_admin

    reload = remount_read(serve_options, options, served)
    remounter = Remounter(result, manager, BUNDLE_KEY, reload, unusable)
    if serve_options.admin_port is not None:
        token = read_token(serve_options.admin_token_file)
        start_admin(serve_options.admin_port, token, remounter, stop)

    def logged(done: Any) -> None:
        if done.exception() is None:
            done.result().log(log)
        else:  # a failed remount leaves what was mounted
            log.error("remount failed (%s); the mounted bundles stay", describe(done.exception()))

    def on_hangup(signum: int, frame: Any) -> None:  # on the remounter's one worker thread
        remounter.request().add_done_callback(logged)

    if hasattr(signal, "SIGHUP") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGHUP, on_hangup)
        if EARLY_HANGUP.is_set():  # sent while serve was starting: that deploy is read now
            EARLY_HANGUP.clear()
            log.info("remount: a SIGHUP came during start-up; re-reading the bundles")
            on_hangup(signal.SIGHUP, None)


def remount_read(
    serve_options: ServeOptions,
    options: Callable[[], dict],
    served: tuple[ModelIdentity, tuple[str, ...]],
) -> Callable[[], MountResult]:
    """A remount's read of the bundles: startup's rules and options (read afresh), checked
    against the weights the server runs (`served`), never the folder's newer ones; a WARNING on
    each remount once the folder's files changed since startup."""
    identity, state = served

    def read() -> MountResult:
        if folder_state(serve_options.model) != state:
            log.warning(
                "remount: %s; bundles are checked against the weights this server runs (built "
                "for the new ones, they are refused): restart serve to serve the new weights",
                changed_message(serve_options.model, "since serve started"),
            )
        model, bundles = serve_options.model, serve_options.bundles
        if not Path(bundles).is_dir():  # a deploy's mv under way: not "every bundle removed"
            raise PipelineError(
                f"bundles folder {bundles} is not a folder now; nothing was changed: remount "
                "again once the deploy has put it back"
            )
        return mount(model, bundles, skip_refused=True, identity=identity, **options())

    return read


def stop_serve() -> None:
    """A graceful stop of serve, as SIGTERM gives it (the admin endpoint's POST /v1/stop)."""
    os.kill(os.getpid(), signal.SIGTERM)


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


def hard_exit() -> None:
    """Exit with status 1 now, from any thread, output flushed."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(1)


def describe(exc: BaseException) -> str:
    """`Type: message at file:line` of the innermost frame, on one line."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}{where}" if message else f"{type(exc).__name__}{where}"
