"""What a push or pull reports while it runs: bytes done of each artifact (for a progress bar),
seconds per phase (for the benchmark), and the bytes that moved and were already there. No printing: the CLI gives a callback that does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# callback(label, done bytes, total bytes, reused bytes, elapsed seconds)
Report = Callable[[str, int, int, int, float], None]


class Meter:
    """Progress of the artifact moving now, and time spent per phase over the whole run (summed
    over the threads that moved blobs at once). Thread-safe."""

    def __init__(self, report: Report | None = None) -> None:
        self.report = report
        self.lock = threading.Lock()
        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}  # process CPU seconds in phases timed with cpu=True
        self.label, self.total, self.done, self.reused, self.started = "", 0, 0, 0, 0.0

    def start(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.reused = label, total, 0, 0
        self.started = time.perf_counter()
        self._tell()

    def advance(self, n: int, reused: bool = False) -> None:
        """n more bytes of the artifact are in place (moved, or already there when reused)."""
        with self.lock:
            self.done = min(self.done + n, self.total)
            self.reused += n if reused else 0
            self._tell()

    def finish(self) -> None:
        self.done = self.total
        self._tell()

    def _tell(self) -> None:
        if self.report is not None and self.total:
            elapsed = time.perf_counter() - self.started
            self.report(self.label, self.done, self.total, self.reused, elapsed)

    def add(self, name: str, seconds: float) -> None:
        """Add seconds timed elsewhere (per piece, without the lock) to `seconds[name]`."""
        with self.lock:
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @contextmanager
    def phase(self, name: str, cpu: bool = False) -> Iterator[None]:
        """Add the time spent inside to `seconds[name]`; with `cpu`, the process's CPU time
        meanwhile to `cpu[name]` (all its threads: exact for a phase that runs alone)."""
        t0, c0 = time.perf_counter(), time.process_time() if cpu else 0.0
        try:
            yield
        finally:
            spent = time.perf_counter() - t0
            used = time.process_time() - c0 if cpu else 0.0
            with self.lock:
                self.seconds[name] = self.seconds.get(name, 0.0) + spent
                if cpu:
                    self.cpu[name] = self.cpu.get(name, 0.0) + used


@dataclass
class Transfer:
    """Bytes and blobs that moved, and those the other side already had."""

    moved_bytes: int = 0
    moved_blobs: int = 0
    reused_bytes: int = 0
    reused_blobs: int = 0

    def add(self, other: Transfer) -> None:
        for k in ("moved_bytes", "moved_blobs", "reused_bytes", "reused_blobs"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
