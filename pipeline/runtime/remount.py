"""Live re-mount: a running server picks up new, changed and removed bundles without a restart.

`remount` runs the same discovery, version rules and one validator as `mount` over the same
bundles folder, then swaps the result into the manager one prefix at a time: a new or changed
version is pinned in place of the old one (requests in flight keep the copy they were handed),
a prefix whose new version is refused or cannot be used with the server's options keeps its old
version (both are WARNING lines with the reason), a prefix whose bundle is gone is unpinned. Entries the server stored are keyed by exact token ids, so an entry continued from an
old version is still exact for those ids (and a lossy one is held to the reuse rule): nothing
derived from a replaced version can serve a request whose ids differ from it.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.runtime.mount import MountedBundle, MountResult, RefusedBundle
from pipeline.runtime.prompt_cache import PromptCacheManager


@dataclass
class Changes:
    """What a remount did, one entry per prefix that changed or was refused."""

    added: list[str] = field(default_factory=list)
    replaced: list[tuple[str, str]] = field(default_factory=list)  # (old name, new name)
    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # still served: unchanged, or its new one refused
    refused: list[RefusedBundle] = field(default_factory=list)  # the old version, if any, stays
    unused: list[tuple[Path, str]] = field(default_factory=list)  # the old version, if any, stays
    # every prefix mounted after the remount: (bundle name, why it is served)
    serving: list[tuple[str, str]] = field(default_factory=list)

    def lines(self) -> list[tuple[int, str]]:
        """(log level, line): one per change, refusals and unusable bundles as WARNING, then
        the totals."""
        info, warn = logging.INFO, logging.WARNING
        out = [(info, f"remount: added {n}") for n in self.added]
        out += [(info, f"remount: replaced {a} by {b}") for a, b in self.replaced]
        out += [(info, f"remount: removed {n} (its bundle is gone)") for n in self.removed]
        out += [
            (warn, f"remount: refused {r.path}: {r.reason} (the mounted version, if any, stays)")
            for r in self.refused
        ]
        out += [
            (warn, f"remount: not used: {p}: {why} (the mounted version, if any, stays)")
            for p, why in self.unused
        ]
        out.append(
            (
                info,
                f"remount: {len(self.added)} added, {len(self.replaced)} replaced, "
                f"{len(self.removed)} removed, {len(self.kept)} kept, {len(self.refused)} "
                f"refused, {len(self.unused)} not usable",
            )
        )
        return out

    def log(self, logger: logging.Logger) -> None:
        for level, line in self.lines():
            logger.log(level, "%s", line)


def _key(b: MountedBundle) -> tuple[str, str]:
    return b.manifest.prefix.name, b.manifest.model.fingerprint


class Remounter:
    """Holds what is mounted for one served model and re-reads the bundles on request; one
    remount at a time, every one on the same worker thread (MLX keeps a stream thread for each
    thread that evaluates arrays: a thread per remount leaked one OS thread per remount)."""

    def __init__(
        self,
        current: MountResult,
        manager: PromptCacheManager,
        model_key: str,
        load: Callable[[], MountResult],
        unusable: Callable[[MountedBundle], str | None] = lambda b: None,
    ) -> None:
        """`load`: mount(...) with the server's options and no manager (skip_refused);
        `current.bundles` is kept as what is pinned after each remount (what the rest of the
        process reads: snapshots' continued_from, the unpin of a changed model folder)."""
        self.result = current
        self.current = {_key(b): b for b in current.bundles}
        self.manager, self.model_key, self.load, self.unusable = manager, model_key, load, unusable
        self._lock = threading.Lock()
        self._queue: queue.Queue[Future] = queue.Queue()
        self._waiting: Future | None = None  # a request not yet started (later ones join it)
        self._worker: threading.Thread | None = None

    def remount(self) -> Changes:
        """Remount on the worker thread and wait for what it did (raises what it raised)."""
        return self.request().result()

    def request(self) -> Future:
        """Ask for a remount on the worker thread; a request made while another waits to start
        joins it (a burst of SIGHUPs is one remount after the one under way)."""
        with self._lock:
            if self._waiting is not None:
                return self._waiting
            future: Future = Future()
            self._waiting = future
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._serve_requests, name="prefix-bundles-remount", daemon=True
                )
                self._worker.start()
            self._queue.put(future)
            return future

    def _serve_requests(self) -> None:
        while True:
            future = self._queue.get()
            with self._lock:
                self._waiting = None
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._remount_now())
            except BaseException as exc:  # noqa: BLE001 - the caller gets it; the worker goes on
                future.set_exception(exc)

    def _remount_now(self) -> Changes:
        found = self.load()
        changes = Changes(refused=list(found.refused))
        fresh = {}
        held = {_refused_name(r) for r in found.refused}  # prefixes that keep their version
        for b in found.bundles:
            why = self.unusable(b)
            if why is None:
                fresh[_key(b)] = b
            else:
                changes.unused.append((b.path, why))
                held.add(b.manifest.prefix.name)
        for key, b in fresh.items():
            self._swap(key, b, changes)
        for key, old in list(self.current.items()):
            if key in fresh:
                continue
            if old.manifest.prefix.name in held:
                changes.kept.append(old.name)
                changes.serving.append((old.name, "its new version was refused or is not usable"))
                continue
            self.manager.unpin(self.model_key, old.name)
            del self.current[key]
            changes.removed.append(old.name)
        self.result.bundles[:] = list(self.current.values())
        return changes

    def _swap(self, key: tuple[str, str], b: MountedBundle, changes: Changes) -> None:
        old = self.current.get(key)
        same = old is not None and (old.name, old.path) == (b.name, b.path)
        if same and old.manifest.cache.file_sha256 == b.manifest.cache.file_sha256:
            changes.kept.append(old.name)  # the same bundle: the copy just loaded is dropped
            changes.serving.append((old.name, "unchanged"))
            return
        self.manager.pin(self.model_key, b.tokens, b.cache, b.name, reload=b.read)
        b = dataclasses.replace(b, cache=[])  # the manager holds it (a preamble shared: once)
        if old is not None and old.name != b.name:
            self.manager.unpin(self.model_key, old.name)
        self.current[key] = b
        if old is None:
            changes.added.append(b.name)
            changes.serving.append((b.name, "added"))
        else:
            changes.replaced.append((old.name, b.name))
            changes.serving.append((b.name, f"replaced {old.name}"))


def _refused_name(refused: RefusedBundle) -> str | None:
    """The prefix name a refused bundle's folder is kept under (<name>/<version>/<model>)."""
    parts = Path(refused.path).parts
    return parts[-3] if len(parts) >= 3 else None


__all__ = ["Changes", "Remounter"]
