"""serve --snapshots: the server's entries spilled to DIR while it serves, so a crash (`kill -9`,
an OOM kill, a power loss) keeps what it learned up to the last spill.

Two halves, on two threads. `capture` runs on the thread that owns the server's cache, right
after it stored an entry (the hook calls `Snapshots.changed` there): it lists the entries as the
graceful stop's save lists them and takes copy-on-write handles to their KV (views, evaluated
there: no byte is copied), so a later change of the server's cache never reaches them. The spill
thread writes the last capture as a new set through `Snapshots` (the one bundle writer, the one
safe tree: a set appears whole or not at all) once the server has been quiet for QUIET_S
seconds after a change, or a change has waited `every` seconds, and never sooner than `every`
after the previous spill. A failed spill is one line; the previous set stays.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from pipeline.format.errors import PipelineError
from pipeline.runtime.prompt_cache import fork_cache
from pipeline.runtime.snapshot_store import Entry

log = logging.getLogger("prefix-bundles")
DEFAULT_EVERY_S = 30.0  # --snapshot-every's default: the least time between two spills
QUIET_S = 2.0  # a spill starts once no entry was stored for this long (the server is quiet)

# what a hook lists: (recency, Entry), or a callable the spill thread resolves to one (or None):
# mlx-openai-server's entries on its own disk are read there, off the request path
Listed = tuple[int, Entry] | Callable[[], "tuple[int, Entry] | None"]


class Spiller:
    """The spill thread of one serve process and the captures the server's thread hands it."""

    def __init__(
        self,
        write: Callable[[list[tuple[int, Entry]], str], None],
        every: float,
        listing: Callable[[], Sequence[Listed]],
        quiet: float = QUIET_S,
    ) -> None:
        """`write(entries, why)`: Snapshots' save (raises PipelineError when nothing was written);
        `listing()`: the hook's entries, called on the thread that owns the server's cache."""
        self.write, self.every, self.listing, self.quiet = write, every, listing, quiet
        self._cond = threading.Condition()
        self._pending: list[Listed] | None = None
        self._first = self._last_change = 0.0  # when the pending capture's changes came
        self._last_spill = -math.inf
        self._written: list[int] | None = None  # the entries of the last spill (tokens, lossy)
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.captures, self.capture_s, self.spills, self.failures = 0, 0.0, 0, 0
        self.capture_max_s = 0.0

    def start(self) -> None:
        """Run the spill thread (a daemon: a kill -9 or the process's exit ends it anywhere; the
        staging folder it leaves is removed at the next start)."""
        self._thread = threading.Thread(target=self._run, name="snapshot-spill", daemon=True)
        self._thread.start()

    def capture(self) -> None:
        """On the thread that owns the server's cache, after it stored an entry: the entries now,
        their KV as evaluated copy-on-write views, for the spill thread. Never raises: a listing
        that fails is one line, and the previous capture stays pending."""
        start = time.perf_counter()
        try:
            listed = [frozen(item) for item in self.listing()]
        except Exception as exc:  # noqa: BLE001 - the request goes on; nothing is spilled from it
            log.error("snapshots: entries not captured for a spill (%s)", _why(exc))
            return
        spent = time.perf_counter() - start
        now = time.monotonic()
        with self._cond:
            if self._pending is None:
                self._first = now
            self._pending, self._last_change = listed, now
            self.captures += 1
            self.capture_s += spent
            self.capture_max_s = max(self.capture_max_s, spent)
            self._cond.notify()

    def due_in(self, now: float) -> float | None:
        """Seconds until the pending capture is due (0: now); None when nothing is pending."""
        if self._pending is None:
            return None
        ready = min(self._last_change + self.quiet, self._first + self.every)
        return max(0.0, ready - now, self._last_spill + self.every - now)

    def spill(self) -> bool:
        """Write the pending capture now, on this thread (the spill thread's step; tests call it).
        False when nothing was pending, the stop came first, the entries are those the last
        spill wrote (only their recency changed), or the write failed (one line)."""
        with self._cond:
            listed, self._pending = self._pending, None
            if listed is None or self._stopped:
                return False
            self._last_spill = time.monotonic()
        entries = [pair for pair in map(resolved, listed) if pair is not None]
        held = sorted(hash((tuple(e.tokens), e.lossy)) for _, e in entries)
        if held == self._written:  # the same entries as the last spill (a hit re-stamped one)
            return False
        why = f" (spilled while serving, {self.captures} captures, {_capture_line(self)})"
        try:
            self.write(entries, why)
        except Exception as exc:  # noqa: BLE001 - serving goes on; the previous set is intact
            self.failures += 1
            log.error(
                "snapshots: spill failed: %s; the next spill is tried after the next new entry, "
                "%g s from now at the earliest", _why(exc), self.every,
            )  # fmt: skip
            return False
        self.spills, self._written = self.spills + 1, held
        return True

    def stop(self) -> None:
        """The server has stopped: no spill starts after this (the stop's own save follows)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                wait = self.due_in(time.monotonic())
                while not self._stopped and wait != 0:
                    self._cond.wait(wait)
                    wait = self.due_in(time.monotonic())
                if self._stopped:
                    return
            self.spill()


def frozen(item: Listed) -> Listed:
    """An entry whose KV no later change of the server's cache reaches: new handles over the same
    buffers (MLX never writes a buffer another handle holds), cut to the offset, evaluated on
    this thread. A deferred one (a callable) is left for the spill thread."""
    if callable(item):
        return item
    stamp, entry = item
    try:
        return stamp, replace(entry, cache=fork_cache(list(entry.cache)))
    except Exception:  # noqa: BLE001 - a cache kind fork_cache cannot copy: the save refuses it
        return stamp, entry


def resolved(item: Listed) -> tuple[int, Entry] | None:
    """A captured entry, or a deferred one read now (None when it is gone: evicted meanwhile)."""
    if not callable(item):
        return item
    try:
        return item()
    except Exception:  # noqa: BLE001 - its file went with an eviction: nothing to spill
        return None


def _capture_line(spiller: Spiller) -> str:
    mean = spiller.capture_s / max(spiller.captures, 1)
    return f"capture {mean * 1000:.2f} ms mean, {spiller.capture_max_s * 1000:.2f} ms max on the server's thread"


def _why(exc: BaseException) -> str:
    if isinstance(exc, PipelineError):
        return str(exc).removeprefix("snapshots: ")
    return f"{type(exc).__name__}: {exc}; the previous set stays"


__all__ = ["DEFAULT_EVERY_S", "QUIET_S", "Listed", "Spiller", "frozen", "resolved"]
