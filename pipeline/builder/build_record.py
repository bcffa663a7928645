"""Which bundles this builder wrote: a private record outside every bundles tree.

An incremental build reuses a parent with no recompute when this builder wrote it: the parent is
validated in full (every byte against its manifest's pins) and the sha256 of that manifest must be
in this record, with the cache file's sha256 it pins. The manifest digest is what the record
vouches for, so it vouches for everything the manifest says the bytes were built for (model
fingerprint, dtype, chunk size, cache layout, the builder's kernels), never for the cache bytes
alone: a copy relabeled as another model's or another builder's has another manifest digest and is
not in the record. The record lives in this user's private cache folder (pipeline.format.memo:
0700, owned by the user, ignored otherwise), never in the bundles tree: whoever can write the
bundles tree (a deploy script, a shared folder, a copied-in bundle) cannot add to it. Whoever can
write this user's home can; that is the boundary.

Records written before format 3 mapped a cache file's sha256 to its BLAKE3; such an entry is
recognised (`recorded_before_manifests`) and is no longer trusted: that parent is recomputed once.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.format.manifest import Manifest
from pipeline.format.memo import load_table, memo_path, update_table

RECORD_FILE = "built-caches.json"
MAX_ENTRIES = 4096  # a bound on the file; beyond it entries are dropped (they cost a recompute)


def record_path() -> Path:
    return memo_path().with_name(RECORD_FILE)


def record_built(manifest_sha256: str, manifest: Manifest) -> None:
    """Remember that this builder wrote the bundle whose manifest has this digest."""

    def change(table: dict[str, str]) -> dict[str, str]:
        table.pop(manifest_sha256, None)
        table[manifest_sha256] = manifest.cache.file_sha256
        return dict(list(table.items())[-MAX_ENTRIES:])

    update_table(record_path(), change)


def built_here(manifest_sha256: str, manifest: Manifest) -> bool:
    """True when this builder wrote the (validated) manifest with this digest."""
    return load_table(record_path()).get(manifest_sha256) == manifest.cache.file_sha256


def recorded_before_manifests(manifest: Manifest) -> bool:
    """True when an older record names this cache file (by its bytes only, not what they are)."""
    return load_table(record_path()).get(manifest.cache.file_sha256) == manifest.cache.file_blake3


__all__ = ["RECORD_FILE", "built_here", "record_built", "record_path", "recorded_before_manifests"]
