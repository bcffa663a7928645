"""Which cache files this builder wrote: a private record outside every bundles tree.

An incremental build reuses a parent with no recompute when this builder wrote it: the parent is
validated in full (every byte against its manifest's pins) and those pins must be in this record,
so its bytes are the bytes this builder wrote. The record lives in this user's private cache
folder (pipeline.format.memo: 0700, owned by the user, ignored otherwise), never in the bundles
tree: whoever can write the bundles tree (a deploy script, a shared folder, a copied-in bundle)
cannot add to it. Whoever can write this user's home can; that is the boundary.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.format.manifest import Manifest
from pipeline.format.memo import load_table, memo_path, save_table

RECORD_FILE = "built-caches.json"
MAX_ENTRIES = 4096  # a bound on the file; beyond it entries are dropped (they cost a recompute)


def record_path() -> Path:
    return memo_path().with_name(RECORD_FILE)


def record_built(manifest: Manifest) -> None:
    """Remember that this builder wrote the cache file the manifest pins."""
    table = load_table(record_path())
    table.pop(manifest.cache.file_sha256, None)
    table[manifest.cache.file_sha256] = manifest.cache.file_blake3
    keep = list(table.items())[-MAX_ENTRIES:]
    save_table(record_path(), dict(keep))


def built_here(manifest: Manifest) -> bool:
    """True when this builder wrote the cache file this (validated) manifest pins."""
    return load_table(record_path()).get(manifest.cache.file_sha256) == manifest.cache.file_blake3


__all__ = ["RECORD_FILE", "built_here", "record_built", "record_path"]
