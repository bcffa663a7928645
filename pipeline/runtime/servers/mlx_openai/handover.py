"""What serve hands mlx-openai-server's spawned model process, and takes back: its options as JSON
(the process starts from a fresh interpreter), exactly the bundles serve validated and reported,
the way a refusal there ends serve, and the admin endpoint's stop sent up to serve."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import asdict, fields
from pathlib import Path

from pipeline.format.errors import PipelineError
from pipeline.runtime.servers.mounted import BUNDLE_KEY, Mounted, log
from pipeline.runtime.servers.options import ServeOptions
from pipeline.runtime.servers.startup import hard_exit

SERVER = "mlx-openai-server"
PATHS = ("model", "bundles", "lockfile", "admin_token_file", "snapshots")


def options_json(options: ServeOptions) -> str:
    """serve's options for the model process."""
    return json.dumps(asdict(options), default=str)


def options_from_json(text: str) -> ServeOptions:
    """The options `options_json` wrote, as the same typed value."""
    values = json.loads(text)
    for name in PATHS:
        values[name] = None if values[name] is None else Path(values[name])
    values["trusted_keys"] = tuple(Path(p) for p in values["trusted_keys"])
    values["rest"], values["argv"] = tuple(values["rest"]), tuple(values["argv"])
    known = {f.name for f in fields(ServeOptions)}
    return ServeOptions(**{k: v for k, v in values.items() if k in known})


def validated(mounted: Mounted) -> dict[str, str]:
    """{bundle path: cache sha256} of what is mounted (for the model process)."""
    return {str(b.path): b.manifest.cache.file_sha256 for b in mounted.result.bundles}


def keep_validated(mounted: Mounted, handed: dict[str, str], where: str) -> None:
    """Serve in `where` exactly what serve validated and reported (`handed`): a bundle that
    changed or appeared in between is unpinned with a WARNING (a remount takes it), one that is
    gone is named; then one line of what `where` serves."""
    for b in list(mounted.result.bundles):
        if handed.get(str(b.path)) != b.manifest.cache.file_sha256:
            mounted.result.bundles.remove(b)
            mounted.manager.unpin(BUNDLE_KEY, b.name)
            log.warning(
                "%s: %s changed after serve validated it: not mounted in %s (SIGHUP or "
                "the admin endpoint mounts it)", SERVER, b.path, where,
            )  # fmt: skip
    for path in sorted(set(handed) - set(validated(mounted))):
        log.warning("%s: %s was validated by serve but is gone from %s", SERVER, path, where)
    log.info("%s: %d bundle(s) pinned in %s", SERVER, len(mounted.result.bundles), where)


def exit_on_refusal() -> None:
    """serve exits 1 when a model process it spawned refused to start (`refuse_in_spawned`
    sends SIGUSR1, after its one `error:` line)."""
    if hasattr(signal, "SIGUSR1") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, lambda signum, frame: hard_exit())


@contextlib.contextmanager
def refusals_end_serve() -> Iterator[None]:
    """In the model process: a refusal (PipelineError) reaches the operator as serve's own
    would, one `error:` line, and serve (its parent) exits 1 before the server reports the child
    it lost (four tracebacks); then this process ends."""
    try:
        yield
    except PipelineError as exc:
        refuse_in_spawned(exc)


def refuse_in_spawned(exc: PipelineError) -> None:
    """`refusals_end_serve`'s line, its parent's exit, then this process's."""
    import time

    sys.stderr.write(f"error: {exc}\n")  # the parent's CLI never sees this process's errors
    sys.stderr.flush()
    parent = os.getppid()
    os.kill(parent, signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.05)  # the parent exits first: it never waits on this process
    os._exit(1)


def stop_parent() -> None:
    """The admin endpoint's POST /v1/stop in the model process (where the endpoint runs): a
    graceful stop of serve, whose stop orders this process to save and close."""
    os.kill(os.getppid(), signal.SIGTERM)


__all__ = [
    "exit_on_refusal",
    "keep_validated",
    "options_from_json",
    "options_json",
    "refusals_end_serve",
    "stop_parent",
    "validated",
]
