"""Read a safetensors file once, straight into MLX arrays, hashing it on a second core as it goes.

Why not `mx.load`: it reads tensors in an arbitrary order, so the bytes cannot be hashed in file
order as they arrive, and hashing the arrays afterwards serialises read and hash. Here the file
is read front to back into the arrays' own memory (no second copy) while a worker thread feeds
the same memory to sha256 (hashlib releases the GIL), so the read costs ~max(read, hash).
"""

from __future__ import annotations

import hashlib
import json
import queue
import struct
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx

CHUNK = 4 << 20
DTYPES = {
    "F32": mx.float32,
    "F16": mx.float16,
    "BF16": mx.bfloat16,
    "U32": mx.uint32,
    "I32": mx.int32,
    "I64": mx.int64,
    "U64": mx.uint64,
    "U16": mx.uint16,
    "I16": mx.int16,
    "U8": mx.uint8,
    "I8": mx.int8,
    "BOOL": mx.bool_,
}


class FormatError(ValueError):
    """The file is not a safetensors layout this reader accepts."""


def _plan(
    header: dict[str, Any], data_start: int, size: int
) -> list[tuple[str, Any, list[int], int, int]]:
    """(name, dtype, shape, start, end) in file order; the tensors must tile the data exactly."""
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info.get("dtype") not in DTYPES:
            raise FormatError(f"tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
        start, end = info["data_offsets"]
        spans.append((name, DTYPES[info["dtype"]], list(info["shape"]), start, end))
    spans.sort(key=lambda s: (s[3], s[4]))  # empty tensors share their offset with the next one
    position = 0
    for name, dtype, shape, start, end in spans:
        expected = dtype.size * int(_prod(shape))
        if start != position or end - start != expected:
            raise FormatError(
                f"tensor {name!r} does not follow the previous one or has the wrong size"
            )
        position = end
    if data_start + position != size:
        raise FormatError(f"file is {size} bytes but its tensors end at {data_start + position}")
    return spans


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _NoDigest:
    def update(self, data: Any) -> None:
        pass


def _hasher(digest: Any, chunks: queue.Queue) -> None:
    while (chunk := chunks.get()) is not None:
        digest.update(chunk)


def read_verified(
    path: Path, hash_bytes: bool = True
) -> tuple[dict[str, mx.array], dict[str, str], str | None]:
    """(arrays, metadata, sha256 of the file) from one front-to-back read of a safetensors file.

    With hash_bytes=False the file is read the same way but not hashed (digest None).
    """
    with open(path, "rb", buffering=0) as fh:
        size = fh.seek(0, 2)
        fh.seek(0)
        prefix = fh.read(8)
        if len(prefix) != 8:
            raise FormatError("file is shorter than a safetensors header")
        (n,) = struct.unpack("<Q", prefix)
        if n > size - 8:
            raise FormatError(f"header length {n} exceeds the file")
        header_bytes = fh.read(n)
        try:
            header = json.loads(header_bytes)
        except ValueError as exc:
            raise FormatError(f"header is not JSON ({exc})") from None
        spans = _plan(header, 8 + n, size)
        digest = hashlib.sha256(prefix + header_bytes) if hash_bytes else _NoDigest()
        chunks: queue.Queue = queue.Queue(maxsize=8)
        worker = threading.Thread(target=_hasher, args=(digest, chunks), daemon=True)
        worker.start()
        try:
            arrays = {
                name: _read_tensor(fh, dtype, shape, end - start, chunks)
                for name, dtype, shape, start, end in spans
            }
        finally:
            chunks.put(None)
            worker.join()
    metadata = header.get("__metadata__") or {}
    return arrays, metadata, digest.hexdigest() if hash_bytes else None


def _read_tensor(
    fh: Any, dtype: Any, shape: list[int], nbytes: int, chunks: queue.Queue
) -> mx.array:
    array = mx.zeros(shape, dtype=dtype)
    mx.eval(array)
    if nbytes == 0:
        return array
    view = memoryview(array).cast("B")  # the array's own, freshly allocated memory
    for offset in range(0, nbytes, CHUNK):
        part = view[offset : offset + CHUNK]
        if fh.readinto(part) != len(part):
            raise FormatError("file ended inside a tensor")
        chunks.put(part)
    return array
