"""cache.safetensors as content-addressed token-range blocks, and back, byte for byte.

The rule (which bytes block k holds, the header and the "rest") is pipeline.format.cache_blocks'
which the manifest's block pins (format 5) follow too; here: the header read from an untrusted
file or artifact, and files read and rebuilt block by block. The artifact records B, and a pull
rebuilds with the B it records.
"""

from __future__ import annotations

import errno
import hashlib
import os
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from pipeline.distribute.untrusted import Unfit, first_error, parse_as
from pipeline.format import regular_files
from pipeline.format.bundle_folder import read_manifest
from pipeline.format.cache_blocks import (  # noqa: F401  (re-exported: defined here before)
    MAX_BLOCK_TOKENS,
    MIN_BLOCK_TOKENS,
    TARGET_BLOCK_BYTES,
    Layout,
    Span,
    assemble,
    block_tokens,
    span,
)
from pipeline.format.regular_files import FileProblem
from pipeline.format.safetensors_read import DTYPE_SIZES

# the header holds the token ids (~4-7 bytes each): 16 MiB is millions of tokens
MAX_HEADER_BYTES = 16 << 20


class TensorEntry(BaseModel):
    """One tensor of a safetensors header."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    dtype: Literal[tuple(DTYPE_SIZES)]  # type: ignore[valid-type]
    shape: Annotated[list[Annotated[int, Field(ge=0, le=1 << 40)]], Field(max_length=64)]
    data_offsets: Annotated[
        list[Annotated[int, Field(ge=0, le=1 << 50)]], Field(min_length=2, max_length=2)
    ]


HEADER = TypeAdapter(dict[str, dict[str, Any]])  # every value an object ("__metadata__" too)


def layout(header: bytes, tokens: int, file_bytes: int, block_size: int | None = None) -> Layout:
    """The block layout of a cache file from its header bytes (B by the rule, or `block_size`
    as an artifact records it); ValueError saying how they do not describe exactly file_bytes
    bytes of tensors."""
    (n,) = struct.unpack("<Q", header[:8].ljust(8, b"\xff"))
    if len(header) != 8 + n:
        raise ValueError(f"the cache header says {n:,} bytes of JSON, it has {len(header) - 8:,}")
    try:
        entries = parse_as(HEADER, header[8:], MAX_HEADER_BYTES)
    except Unfit as exc:
        raise ValueError(f"the cache header does not parse ({exc})") from None
    spans = [_span(k, e, len(header), tokens) for k, e in entries.items() if k != "__metadata__"]
    return assemble(header, spans, tokens, file_bytes, block_size)


def _span(name: str, entry: dict, base: int, tokens: int) -> Span:
    try:
        e = TensorEntry.model_validate(entry, strict=True)
    except ValidationError as exc:
        problem = first_error(exc.errors(include_url=False)[0])
        raise ValueError(f"the cache header's tensor {name[:60]!r}: {problem}") from None
    shape, (a, b), size = e.shape, e.data_offsets, DTYPE_SIZES[e.dtype]
    count = 1
    for d in shape:
        count *= d
    if b - a != count * size:
        why = f"has {b - a:,} bytes, its shape {count * size:,}"
        raise ValueError(f"the cache header's tensor {name[:60]!r} {why}")
    return span(name, base + a, base + b, shape, size, tokens)


def open_regular(path: Path) -> int:
    """A read descriptor of path (regular_files.open_regular, no link followed): a FIFO or
    device never blocks, and anything but a regular file is an OSError."""
    try:
        return regular_files.open_regular(path, follow=False)
    except FileProblem as exc:
        raise OSError(errno.EINVAL, str(exc), str(path)) from None


def peer_tokens(bundle: Path) -> int:
    """The token count a bundle folder's manifest.json records, read as the validator reads it
    (a regular file, no link, capped, strict schema, either kind): only to cut its cache file
    into blocks whose digests are then checked; BundleError naming the file otherwise."""
    return read_manifest(bundle, None, kind=None).tokens.count


def read_layout(source: Path | int, tokens: int, block_size: int | None = None) -> Layout:
    """The layout of a cache file (a path, or a descriptor open on it); ValueError when its
    header is not one, OSError when it cannot be read."""
    fd = source if isinstance(source, int) else open_regular(source)
    try:
        first = os.pread(fd, 8, 0)
        (n,) = struct.unpack("<Q", first.ljust(8, b"\xff"))
        if n > MAX_HEADER_BYTES:
            raise ValueError(
                f"the cache header is {n:,} bytes, over the {MAX_HEADER_BYTES:,} it may have"
            )
        header = first + os.pread(fd, n, 8)
        size = os.fstat(fd).st_size
    finally:
        if not isinstance(source, int):
            os.close(fd)
    return layout(header, tokens, size, block_size)


class Source:
    """A cache file (a path, or a descriptor open on it) read for its blocks by pread, never
    mapped: a file cut short meanwhile reads short (or zeros past its end), never SIGBUS."""

    def __init__(self, source: Path | int, plan: Layout) -> None:
        self.plan = plan
        self.fd = os.dup(source) if isinstance(source, int) else open_regular(source)

    def close(self) -> None:
        os.close(self.fd)

    def block(self, k: int) -> bytes:
        return b"".join(os.pread(self.fd, n, o) for o, n in self.plan.block_ranges(k))

    @contextmanager
    def views(self, k: int) -> Iterator[list[memoryview]]:
        """Block k's runs read into one buffer, as views in order; released on exit. Past a
        file's end (cut short while read) a run reads zeros: its blob then has another digest,
        and a push's check of its pinned files refuses the change before any tag moves."""
        ranges = list(self.plan.block_ranges(k))
        whole = memoryview(bytearray(sum(n for _, n in ranges)))
        parts, at = [], 0
        for offset, n in ranges:
            part = whole[at : at + n]
            done = 0
            while done < n:
                got = os.preadv(self.fd, [part[done:]], offset + done)
                if got == 0:
                    break
                done += got
            parts.append(part)
            at += n
        try:
            yield parts
        finally:
            for p in parts:
                p.release()
            whole.release()

    def rest(self) -> bytes:
        return b"".join(os.pread(self.fd, n, o) for o, n in self.plan.rest_ranges())


class Target:
    """A cache file being rebuilt: created (never through a link), its size set first, then blobs
    written where they belong; or `fd`, a partly rebuilt file of an interrupted pull (already
    checked to be a regular file of its own), whose blobs are checked by `holds`."""

    def __init__(self, path: Path, plan: Layout, fd: int | None = None) -> None:
        self.plan = plan
        self.resumed = fd is not None
        if fd is None:
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(path, flags, 0o644)
        self.fd = fd
        try:
            os.ftruncate(fd, plan.file_bytes)
            if not self.resumed:
                _allocate(fd, plan.file_bytes)
            os.pwrite(fd, plan.header, 0)
        except BaseException:
            os.close(fd)
            raise
        # one writer at a time: threads writing one file at once contend for its inode lock in
        # the kernel (spinning on 2 cores); taking turns here costs a pull less
        self.lock = threading.Lock()

    def close(self) -> None:
        os.close(self.fd)

    def holds(self, ranges: list[tuple[int, int]], digest: str, size: int) -> bool:
        """Whether the file already holds a blob of this digest at these runs."""
        if sum(n for _, n in ranges) != size:
            return False
        h = hashlib.sha256()
        for offset, n in ranges:
            h.update(os.pread(self.fd, n, offset))
        return "sha256:" + h.hexdigest() == digest

    def writer(self, ranges: Iterator[tuple[int, int]]) -> Writer:
        return Writer(self.fd, list(ranges), self.lock)


def _allocate(fd: int, size: int) -> None:
    """Give a new file its blocks up front where the system can (Linux fallocate; elsewhere, or
    where the filesystem cannot, it stays sparse): writing 1 GB into holes cost ext4 ~20 % more
    kernel time than writing into allocated blocks."""
    import ctypes

    try:
        fallocate = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fallocate(fd, 0, 0, size)  # a failure leaves the file sparse: the writes still fill it


class Writer:
    """A sink for one blob's bytes as they stream: each piece goes to its runs in the file."""

    def __init__(
        self, fd: int, ranges: list[tuple[int, int]], lock: threading.Lock | None = None
    ) -> None:
        self.fd, self.ranges, self.i, self.done = fd, ranges, 0, 0
        self.lock = lock or threading.Lock()

    def __call__(self, data: bytes) -> None:
        with self.lock:
            self._write(memoryview(data))

    def _write(self, view: memoryview) -> None:
        while view and self.i < len(self.ranges):
            offset, n = self.ranges[self.i]
            take = min(n - self.done, len(view))
            os.pwrite(self.fd, view[:take], offset + self.done)
            view, self.done = view[take:], self.done + take
            if self.done == n:
                self.i, self.done = self.i + 1, 0

    @property
    def size(self) -> int:
        return sum(n for _, n in self.ranges)
