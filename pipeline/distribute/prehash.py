"""The blocks' sha256 of bundles about to be pushed, computed while the validator reads them.

A push validates each bundle first, then hashes every block to name it (HEAD, upload). Both read
the whole cache file; done one after the other they cost a ~1 GB push ~0.6 s. Here the hashing
starts on worker threads before the validator runs: local work only, nothing is sent before a
bundle passes. A digest is used only for the same file, unchanged by its stat (as the hash memo
trusts it) from before it was hashed until it is asked for, cut by the same layout; any other
block is hashed by the push itself, and the registry checks every uploaded blob's digest.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from pipeline.distribute import oci
from pipeline.distribute.blocks import Layout, Source, open_regular, peer_tokens, read_layout
from pipeline.format import memo
from pipeline.format.bundle_folder import CACHE_FILE


class Prehash:
    """Block digests of local bundles, computing in the background; close() when done."""

    def __init__(self, bundles: list[Path]) -> None:
        self.pool = ThreadPoolExecutor(oci.TRANSFERS)
        self.sources: list[Source] = []
        self.found: dict[tuple[str, int, int, int], Future] = {}
        for bundle in bundles:
            self._start(Path(bundle) / CACHE_FILE)

    def _start(self, path: Path) -> None:
        fd = None
        try:  # the manifest is not validated yet: it only says how to cut; the validator judges
            tokens = peer_tokens(path.parent)  # never blocks on a FIFO, never reads /dev/zero
            fd = open_regular(path)  # keyed by the stat of the file hashed, not of a name
            key = memo.open_key(os.path.realpath(path), os.fstat(fd))
            plan = read_layout(fd, tokens)
            source = Source(fd, plan)
        except Exception:  # noqa: BLE001 - an unreadable bundle: the validator says why
            return
        finally:
            if fd is not None:
                os.close(fd)
        self.sources.append(source)
        for k in range(plan.blocks):
            future = self.pool.submit(_digest, source, k)
            self.found[key, plan.tokens, plan.block_tokens, k] = future

    def digest(
        self, path: Path, plan: Layout, k: int, st: os.stat_result | None = None
    ) -> str | None:
        """Block k's sha256 as computed ahead, or None (not computed, or the file changed);
        `st`: the fstat of the file the caller reads (else the path's stat now)."""
        key = memo.open_key(os.path.realpath(path), st) if st else memo.stat_key(path)
        future = self.found.get((key, plan.tokens, plan.block_tokens, k))
        return future.result() if future is not None else None

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for source in self.sources:
            source.close()


def _digest(source: Source, k: int) -> str:
    h = hashlib.sha256()
    with source.views(k) as parts:
        for p in parts:
            h.update(p)
    return "sha256:" + h.hexdigest()
