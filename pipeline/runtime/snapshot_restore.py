"""Which snapshots of a set a start restores, and what it reads to decide: every manifest first
(through the one validator, no tensor read), then, hottest first, only the snapshots it keeps.

Left out before any tensor is read: one the server's options cannot use (`unusable`, a refusal),
one whose source is not mounted and trusted now (`untrusted`), a copy of a kept one (the same
cache file by inode, or the same bytes or tokens by its manifest) and one over the byte budget.
Left out after its load: one a mounted bundle or a kept snapshot holds whole. So the start's peak
memory is the budget plus one snapshot, however many links or copies the set holds.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.format.bundle_folder import CACHE_FILE
from pipeline.format.errors import BundleError
from pipeline.format.fingerprint import ModelIdentity
from pipeline.format.manifest import Manifest
from pipeline.format.validate import Validated
from pipeline.runtime.snapshot_store import load_head, shown

log = logging.getLogger("prefix-bundles")
HELD = "held by a bundle or a hotter snapshot"
UNTRUSTED = "continuing a bundle not mounted now"
REFUSED = ""  # counted as refused, not as left out


@dataclass
class Chosen:
    """What a start restores from one set: (snapshot, its token ids), hottest first."""

    kept: list[tuple[Validated, np.ndarray]] = field(default_factory=list)
    left: dict[str, int] = field(default_factory=dict)
    refused: int = 0
    nbytes: int = 0

    def leave(self, why: str) -> None:
        self.left[why] = self.left.get(why, 0) + 1


def untrusted(manifest: Manifest, trusted: set[str]) -> str | None:
    """Why a snapshot's source is not served now (None: every bundle it may continue is mounted
    and trusted, by manifest digest): a learned entry is held to what holds its source today."""
    info = manifest.snapshot
    if info.depends_on is None:
        return (
            f"written by an older release (format {manifest.format_version}), which did not "
            "record the bundles it continues, so it cannot prove its source; not restored (the "
            "next save writes what the server holds again)"
        )
    for source in info.depends_on:
        if source.manifest_sha256 not in trusted:
            return (
                f"it continues bundle {source.bundle} (manifest sha256 "
                f"{source.manifest_sha256[:16]}..), which is not mounted and trusted now "
                "(refused, removed, or replaced by another build); not restored"
            )
    return None


def choose_and_load(
    heads: Sequence[Validated],
    budget: int,
    held: list[np.ndarray],
    unusable: Callable[[Any], str | None],
    trusted: set[str],
    loader: tuple[ModelIdentity, Any],
) -> Chosen:
    """Hottest first: decide each snapshot by its manifest, load only what may be kept, then
    leave out what `held` (the bundles' tokens, then each kept snapshot's) holds whole."""
    chosen, seen = Chosen(), set()
    for head in sorted(heads, key=lambda h: h.manifest.snapshot.rank):
        why = _by_manifest(head, chosen, seen, budget, unusable, trusted)
        if why is not None:
            if why != REFUSED:
                chosen.leave(why)
            continue
        try:
            v = load_head(head, *loader)
        except BundleError as exc:
            log.warning("refused snapshot %s: %s", shown(exc.bundle), shown(exc.reason))
            chosen.refused += 1
            continue
        ids = np.asarray(v.tokens, dtype=np.int64)
        if any(len(ids) <= len(h) and np.array_equal(h[: len(ids)], ids) for h in held):
            chosen.leave(HELD)  # its arrays are dropped here: the peak is one snapshot more
            continue
        held.append(ids)
        chosen.nbytes += v.manifest.cache.nbytes
        chosen.kept.append((v, ids))
    return chosen


def _by_manifest(
    head: Validated,
    chosen: Chosen,
    seen: set,
    budget: int,
    unusable: Callable[[Any], str | None],
    trusted: set[str],
) -> str | None:
    """Why a snapshot is left out before it is read (None: load it); a refusal and a source no
    longer trusted are one line each."""
    why = unusable(head)
    if why is not None:
        log.warning("refused snapshot %s: %s", shown(head.path), why)
        chosen.refused += 1
        return REFUSED
    why = untrusted(head.manifest, trusted)
    if why is not None:
        log.warning("snapshots: dropped %s: %s", shown(head.path), why)
        return UNTRUSTED
    keys = _copies(head)
    if keys & seen:
        return HELD  # a link or a copy of a hotter snapshot: restored once
    if chosen.nbytes + head.manifest.cache.nbytes > budget:
        return "over the budget"
    seen.update(keys)
    return None


def _copies(head: Validated) -> set:
    """What makes two snapshots one: the same cache file (a hard link), the same bytes, the same
    tokens of the same model and template (its id)."""
    m = head.manifest
    keys = {("bytes", m.cache.file_sha256), ("id", m.build_key)}
    try:
        st = os.stat(head.path / CACHE_FILE, follow_symlinks=False)
        keys.add(("inode", st.st_dev, st.st_ino))
    except OSError:
        pass  # the load refuses it with its reason
    return keys


__all__ = ["Chosen", "choose_and_load", "untrusted"]
