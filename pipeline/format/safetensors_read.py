"""Read a safetensors file: its header through the safetensors library, its data in one pass.

The header is parsed and checked by the `safetensors` library (length, JSON, dtypes, offsets that
tile the data exactly, nothing past the end). The data pass goes front to back: when loading, MLX's
own reader fills fresh arrays (each page touched once) and worker threads hash the arrays' memory,
one tensor behind the read; otherwise the file's bytes stream through the hashers. BLAKE3 and, for
a full verification, sha256 release the GIL, so a verified load costs about max(read, hash).

A file is opened once (`open_file`: no link followed, regular files only, never blocking) and
every later step reads that open file: its stat, the header (the library reads it through
/proc/self/fd), the load (MLX reads the same descriptor path) and the hashes. No path is resolved
twice, so a folder swapped in between cannot give the stat of one file and the bytes of another.
"""

from __future__ import annotations

import hashlib
import os
import queue
import stat
import struct
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHUNK = 4 << 20
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U64": 8, "I32": 4, "U32": 4,
    "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip
SMALL = 8  # tensors of at most this many bytes are kept as raw bytes (scalars)


class FormatError(ValueError):
    """The file is not a safetensors layout this reader accepts."""


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # safetensors code: "F32", "BF16", "U32", ...
    shape: tuple[int, ...]
    start: int  # absolute file offsets
    end: int


@dataclass(frozen=True)
class Header:
    raw: bytes  # the 8-byte length and the JSON header, as in the file
    tensors: tuple[Tensor, ...]  # in file order
    metadata: dict[str, str]

    def by_name(self) -> dict[str, Tensor]:
        return {t.name: t for t in self.tensors}


@dataclass(frozen=True)
class OpenFile:
    """One open regular file: `stat` is its fstat when opened; `fd_path` names this descriptor
    (not the path it was opened by) for libraries that take a path."""

    path: Path
    fd: int
    stat: os.stat_result

    @property
    def fd_path(self) -> str:
        proc = f"/proc/self/fd/{self.fd}"
        return proc if sys.platform.startswith("linux") else f"/dev/fd/{self.fd}"

    def real_path(self) -> str:
        """Where the open file is now (the kernel's name for it where it says, else the path)."""
        try:
            return os.readlink(f"/proc/self/fd/{self.fd}")
        except OSError:
            return os.path.realpath(self.path)

    def restat(self) -> os.stat_result:
        return os.fstat(self.fd)


@contextmanager
def open_file(path: Path) -> Iterator[OpenFile]:
    """Open path once for reading: a link, FIFO or device is a FormatError (never blocks)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise FormatError(f"cannot be opened ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError("is not a regular file")
        yield OpenFile(Path(path), fd, st)
    finally:
        os.close(fd)


def read_header(source: Path | OpenFile) -> Header:
    """Parse and check the header (FormatError when the library refuses it)."""
    if not isinstance(source, OpenFile):
        with open_file(source) as opened:
            return read_header(opened)
    from safetensors import SafetensorError, safe_open

    prefix = os.pread(source.fd, 8, 0)
    if len(prefix) != 8:
        raise FormatError("file is shorter than a safetensors header")
    (n,) = struct.unpack("<Q", prefix)
    raw = prefix + os.pread(source.fd, min(n, 100 << 20), 8)
    try:
        with safe_open(source.fd_path, framework="numpy") as f:
            names = list(f.offset_keys())
            layout = [(name, f.get_slice(name)) for name in names]
            tensors_info = [(name, s.get_dtype(), tuple(s.get_shape())) for name, s in layout]
            metadata = dict(f.metadata() or {})
    except SafetensorError as exc:
        raise FormatError(str(exc)) from None
    tensors, position = [], len(raw)
    for name, dtype, shape in tensors_info:
        if dtype not in DTYPE_SIZES:
            raise FormatError(f"tensor {name!r} has unsupported dtype {dtype!r}")
        size = DTYPE_SIZES[dtype] * _prod(shape)
        tensors.append(Tensor(name, dtype, shape, position, position + size))
        position += size
    return Header(raw, tuple(tensors), metadata)


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass
class DataRead:
    digests: dict[str, str]  # hex digest of the whole file per algorithm asked for
    arrays: dict[str, Any]  # MLX arrays by tensor name, when asked to load
    small: dict[str, bytes]  # raw bytes of every tensor of at most SMALL bytes


def _new_digest(name: str) -> Any:
    if name == "blake3":
        from blake3 import blake3

        return blake3(max_threads=blake3.AUTO)
    return hashlib.new(name)


class _Hashers:
    """One thread per digest, each fed the same chunks (hashlib and blake3 release the GIL). The
    file is read into a few reused buffers, each back in the pool once every digest has taken it:
    a fresh bytes object per read faults in its pages again (a 1 GB read took 0.41 s that way,
    0.2 s into reused buffers, the hash alongside)."""

    def __init__(self, digests: dict[str, Any], buffers: int = 3) -> None:
        self.queues = {name: queue.Queue(maxsize=8) for name in digests}
        self.free: queue.Queue[bytearray] = queue.Queue()
        for _ in range(buffers if digests else 1):
            self.free.put(bytearray(CHUNK))
        self.threads = [
            threading.Thread(target=self._drain, args=(digests[n], q), daemon=True)
            for n, q in self.queues.items()
        ]
        for t in self.threads:
            t.start()

    def put(self, chunk: Any, buffer: _Lent | None = None) -> None:
        """Hash chunk; a lent buffer goes back to the pool once every digest has taken it."""
        if buffer is not None:
            buffer.left = len(self.queues)
            if not self.queues:
                self.free.put(buffer.data)
        for q in self.queues.values():
            q.put((chunk, buffer))

    def read(self, fh: Any, n: int) -> memoryview:
        """The next n (<= CHUNK) bytes of fh, read into a pooled buffer and put to the digests
        (the view is valid until the next read: copy what is kept)."""
        data = self.free.get()
        view = memoryview(data)[:n]
        got = 0
        while got < n and (step := fh.readinto(view[got:])):
            got += step
        if got != n:
            self.free.put(data)
            raise FormatError("file ended early")
        self.put(view, _Lent(data))
        return view

    def _drain(self, digest: Any, chunks: queue.Queue) -> None:
        while (item := chunks.get()) is not None:
            chunk, buffer = item
            digest.update(chunk)
            if buffer is not None and buffer.release():
                self.free.put(buffer.data)

    def close(self) -> None:
        for q in self.queues.values():
            q.put(None)
        for t in self.threads:
            t.join()


class _Lent:
    """A pooled buffer out with the digests: the count of those still to take it."""

    def __init__(self, data: bytearray) -> None:
        self.data, self.left, self.lock = data, 0, threading.Lock()

    def release(self) -> bool:
        with self.lock:
            self.left -= 1
            return self.left == 0


def read_data(
    source: Path | OpenFile, header: Header, *, digests: tuple[str, ...], load: bool
) -> DataRead:
    """One front-to-back pass over the file: hash it ("blake3", "sha256"), load the tensors, keep
    the scalars (only these are read when nothing is to be hashed or loaded)."""
    if not isinstance(source, OpenFile):
        with open_file(source) as opened:
            return read_data(opened, header, digests=digests, load=load)
    hashers = {name: _new_digest(name) for name in digests}
    chunks = _Hashers(hashers)
    result = DataRead({}, {}, {})
    try:
        with os.fdopen(os.dup(source.fd), "rb", buffering=0) as fh:
            fh.seek(0)
            raw = _read_exact(fh, len(header.raw))
            if raw != header.raw:
                raise FormatError("header changed while the file was being read")
            chunks.put(raw)
            if load:
                _load_tensors(source, header, chunks, result)
            elif digests:
                _stream_tensors(fh, header, chunks, result)
            else:  # nothing to hash or load: only the scalars are read
                _read_small(source, header, result)
            if os.fstat(fh.fileno()).st_size != _data_end(header):
                raise FormatError("file has bytes past its last tensor")
    finally:
        chunks.close()
    result.digests = {name: h.hexdigest() for name, h in hashers.items()}
    return result


def _data_end(header: Header) -> int:
    return header.tensors[-1].end if header.tensors else len(header.raw)


def _stream_tensors(fh: Any, header: Header, chunks: _Hashers, result: DataRead) -> None:
    """Read every tensor's bytes through the hashers without keeping them (verify)."""
    for t in header.tensors:
        data = _read_into(fh, t.end - t.start, chunks)
        if t.end - t.start <= SMALL:
            result.small[t.name] = data


def _read_small(source: OpenFile, header: Header, result: DataRead) -> None:
    for t in header.tensors:
        if t.end - t.start <= SMALL:
            data = os.pread(source.fd, t.end - t.start, t.start)
            if len(data) != t.end - t.start:
                raise FormatError("file ended early")
            result.small[t.name] = data


def _load_tensors(source: OpenFile, header: Header, chunks: _Hashers, result: DataRead) -> None:
    """Load with MLX's own reader (parallel reads into fresh arrays, each page touched once: no
    zero-filled buffers to overwrite), then hash the arrays' memory itself in file order. The
    digest is over the exact bytes handed out; a file swapped after the header was read fails it,
    or the name, dtype and shape checks below. (Measured on 2 cores: evaluating tensor by tensor
    to overlap hashing with reading was 2x slower than one parallel load followed by the hash.)"""
    import mlx.core as mx

    loaded = mx.load(source.fd_path, format="safetensors")  # this descriptor, not the path
    if set(loaded) != {t.name for t in header.tensors}:
        raise FormatError("tensors changed while the file was being read")
    for t in header.tensors:
        array = loaded[t.name]
        if tuple(array.shape) != t.shape or array.dtype != _mlx_dtype(t):
            raise FormatError(f"tensor {t.name!r} changed while the file was being read")
    mx.eval(list(loaded.values()))
    for t in header.tensors:
        view = memoryview(loaded[t.name]).cast("B")
        if len(view) != t.end - t.start:
            raise FormatError(
                f"tensor {t.name!r}: {len(view)} bytes loaded, the header says otherwise"
            )
        chunks.put(view)
        result.arrays[t.name] = loaded[t.name]
        if t.end - t.start <= SMALL:
            result.small[t.name] = bytes(view)


def _read_exact(fh: Any, n: int) -> bytes:
    data = fh.read(n)
    if len(data) != n:
        raise FormatError("file ended early")
    return data


def _mlx_dtype(t: Tensor) -> Any:
    import mlx.core as mx

    dtypes = {
        "F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16, "U32": mx.uint32,
        "I32": mx.int32, "I64": mx.int64, "U64": mx.uint64, "U16": mx.uint16, "I16": mx.int16,
        "U8": mx.uint8, "I8": mx.int8, "BOOL": mx.bool_,
    }  # fmt: skip
    if t.dtype not in dtypes:
        raise FormatError(f"tensor {t.name!r}: dtype {t.dtype} cannot be loaded into MLX")
    return dtypes[t.dtype]


def _read_into(fh: Any, nbytes: int, chunks: _Hashers) -> bytes:
    """Read nbytes through the hashers; return them when they are few (scalars)."""
    kept = b""
    for offset in range(0, nbytes, CHUNK):
        part = chunks.read(fh, min(CHUNK, nbytes - offset))
        if nbytes <= SMALL:
            kept = bytes(part)
    return kept
