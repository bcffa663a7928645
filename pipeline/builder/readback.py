"""Read a written cache file back once: its digests, and proof that its tensors hold exactly the
bytes of the in-memory cache it was written from.

The manifest pins the digests of what this one read saw, and the same read compares every
tensor's bytes with the cache that was saved, so the pinned bytes are the compared bytes: a full-
precision bundle then continues exactly as the builder's cache does (pipeline.builder.fidelity),
with no model run and no second read of ~1 GB.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from pipeline.format import memo
from pipeline.format.errors import BuildError
from pipeline.format.fingerprint import FileDigests

BLOCK = 8 << 20  # bytes per read


def saved_arrays(cache: list[Any]) -> dict[str, Any]:
    """The arrays mlx-lm's save_prompt_cache stores for `cache`, by tensor name (both layouts
    name the flattened states alike: "<layer>.<index>")."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    return {k: v for k, v in tree_flatten([c.state for c in cache]) if isinstance(v, mx.array)}


def read_back(path: Path, expected: dict[str, Any] | None = None) -> FileDigests:
    """sha256, BLAKE3 and size of the file from one read; with `expected` (saved_arrays), also
    BuildError unless every expected tensor is in the file and holds exactly its bytes. The memo
    keys the digest by the stat of the file as it was read (a later change re-hashes)."""
    from blake3 import blake3

    sha, b3 = hashlib.sha256(), blake3(max_threads=blake3.AUTO)
    buf = memoryview(bytearray(BLOCK))
    with open(path, "rb") as fh:
        key = memo.open_key(os.path.realpath(path), os.fstat(fh.fileno()))
        size = _read_all(fh, buf, (sha, b3), _spans(fh, (sha, b3), path, expected))
    digests = FileDigests(sha.hexdigest(), b3.hexdigest(), size)
    memo.store(key, digests.blake3)
    return digests


def _spans(fh: Any, hashes: tuple, path: Path, expected: dict[str, Any] | None) -> list:
    """Read and hash the safetensors header; (start, end, name, bytes view) of each expected
    tensor, in file order."""
    import numpy as np

    head = fh.read(8)
    header_bytes = fh.read(int.from_bytes(head, "little")) if len(head) == 8 else b""
    for h in hashes:
        h.update(head)
        h.update(header_bytes)
    if expected is None:
        return []
    try:
        header = json.loads(header_bytes)
        offsets = {n: t["data_offsets"] for n, t in header.items() if n != "__metadata__"}
    except (ValueError, TypeError, KeyError) as exc:
        raise BuildError(f"{path}: the written cache file's header is unreadable ({exc})") from None
    missing = sorted(set(expected) - set(offsets))
    if missing:
        raise BuildError(f"{path}: the written cache file lacks tensor {missing[0]}")
    base = 8 + len(header_bytes)
    spans = []
    for name, array in expected.items():
        import mlx.core as mx

        view = np.frombuffer(memoryview(mx.contiguous(array)), dtype=np.uint8)
        begin, end = offsets[name]
        if end - begin != view.size:
            raise BuildError(f"{path}: tensor {name} holds {end - begin} bytes, not {view.size}")
        spans.append((base + begin, base + end, name, view))
    return sorted(spans, key=lambda s: s[0])


def _read_all(fh: Any, buf: memoryview, hashes: tuple, spans: list) -> int:
    """Hash the rest of the file block by block, comparing the blocks that hold expected tensors;
    the file's size."""
    import numpy as np

    pos = fh.tell()
    while n := fh.readinto(buf):
        block = buf[:n]
        for h in hashes:
            h.update(block)
        got = np.frombuffer(block, dtype=np.uint8)
        for start, end, name, view in spans:
            lo, hi = max(start, pos), min(end, pos + n)
            if lo < hi and not np.array_equal(
                got[lo - pos : hi - pos], view[lo - start : hi - start]
            ):
                raise BuildError(
                    f"{fh.name}: tensor {name} as read back differs from the cache that was "
                    f"saved (bytes {lo}-{hi}); the disk or the writer changed it: rebuild"
                )
        pos += n
    return pos


__all__ = ["read_back", "saved_arrays"]
