"""cache.safetensors as token-range blocks: the rule the manifest's block pins (format 5) and an
OCI artifact's blobs both follow, and the digests that prove a file block by block.

The rule (a pure byte layout: it never depends on what a tensor means):
- a **token tensor** is one of rank >= 2 whose axis -2 has the cache's token count T (KVCache keys
  and values [1, heads, T, head_dim]; a quantized cache's packed values, scales and biases, which
  are quantized per position along head_dim);
- block k holds, for every token tensor in name order and every leading index (head), the rows of
  tokens [kB, min((k+1)B, T)): so two caches whose first N positions are the same bytes have the
  same blocks for every whole block below N, whatever their lengths;
- every other tensor (the layout's scalars; a rotating cache's ring buffer or an arrays cache,
  which have no token axis of length T) is the "rest", in file order, and the header (8-byte
  length and JSON, metadata included) is the "header".
Header, rest and blocks tile the file exactly, so their sha256s prove every byte of it. B is a
fixed function of the cache layout: 64 tokens, halved (down to 16) while a block would exceed
16 MiB; the manifest and the artifact record the B they were cut with.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pipeline.format.safetensors_read import DTYPE_SIZES, Header

MAX_BLOCK_TOKENS = 64
MIN_BLOCK_TOKENS = 16
TARGET_BLOCK_BYTES = 16 << 20
# hashlib releases the GIL on large updates: blocks are hashed on this many threads at most
HASH_THREADS = min(8, os.cpu_count() or 1)


@dataclass(frozen=True)
class Span:
    """One tensor's bytes in the file: [start, end), its leading count and row size."""

    name: str
    start: int
    end: int
    lead: int  # product of the dims before axis -2 (heads); 0 for a non-token tensor
    row: int  # bytes of one token row (axis -1 times the dtype size)


@dataclass(frozen=True)
class Layout:
    header: bytes  # the file's first bytes: 8-byte length and JSON header
    tokens: int
    block_tokens: int
    token_spans: tuple[Span, ...]  # in name order
    rest_spans: tuple[Span, ...]  # in file order
    file_bytes: int

    @property
    def blocks(self) -> int:
        if not self.token_spans:
            return 0
        return -(-self.tokens // self.block_tokens)

    def block_ranges(self, k: int) -> Iterator[tuple[int, int]]:
        """(file offset, length) of block k's runs, in the order the block holds them."""
        t0 = k * self.block_tokens
        t1 = min(t0 + self.block_tokens, self.tokens)
        for s in self.token_spans:
            for p in range(s.lead):
                yield s.start + (p * self.tokens + t0) * s.row, (t1 - t0) * s.row

    def rest_ranges(self) -> Iterator[tuple[int, int]]:
        for s in self.rest_spans:
            yield s.start, s.end - s.start

    def compatible(self, other: Layout) -> bool:
        """Whether block k of one is block k of the other when their bytes agree (same rule)."""
        mine = [(s.name, s.lead, s.row) for s in self.token_spans]
        return self.block_tokens == other.block_tokens and mine == [
            (s.name, s.lead, s.row) for s in other.token_spans
        ]


def block_tokens(bytes_per_token: int) -> int:
    """B by the rule: 64 tokens, halved (down to 16) while a block would exceed 16 MiB."""
    b = MAX_BLOCK_TOKENS
    while b > MIN_BLOCK_TOKENS and b * bytes_per_token > TARGET_BLOCK_BYTES:
        b //= 2
    return b


def span(name: str, start: int, end: int, shape: list[int] | tuple[int, ...], size: int, tokens: int) -> Span:  # fmt: skip
    """A tensor of `shape` (items of `size` bytes) at [start, end): a token tensor when its
    axis -2 has the cache's token count."""
    count = 1
    for d in shape:
        count *= d
    is_token = len(shape) >= 2 and shape[-2] == tokens and tokens > 0
    lead = count // (tokens * shape[-1]) if is_token and shape[-1] else 0
    return Span(name, start, end, lead, shape[-1] * size if lead else 0)


def assemble(
    header: bytes, spans: list[Span], tokens: int, file_bytes: int, block_size: int | None = None
) -> Layout:
    """The layout of a file whose header is `header` and tensors `spans` (B by the rule, or
    `block_size` as recorded); ValueError unless they tile exactly file_bytes bytes."""
    position = len(header)
    for s in sorted(spans, key=lambda s: s.start):
        if s.start != position:
            raise ValueError("the cache header's tensors do not tile the file")
        position = s.end
    if position != file_bytes:
        raise ValueError(
            f"the cache header describes {position:,} bytes, the manifest {file_bytes:,}"
        )
    token = tuple(sorted((s for s in spans if s.lead), key=lambda s: s.name))
    rest = tuple(sorted((s for s in spans if not s.lead), key=lambda s: s.start))
    b = block_tokens(sum(s.lead * s.row for s in token)) if block_size is None else block_size
    if b < 1:
        raise ValueError(f"a block of {b} tokens")
    return Layout(header, tokens, b, token, rest, file_bytes)


def header_layout(header: Header, tokens: int, file_bytes: int, block_size: int | None) -> Layout:
    """The layout of a file whose header the safetensors library parsed (the validator's)."""
    spans = [
        span(t.name, t.start, t.end, t.shape, DTYPE_SIZES[t.dtype], tokens) for t in header.tensors
    ]
    return assemble(header.raw, spans, tokens, file_bytes, block_size)


@dataclass(frozen=True)
class Digests:
    """sha256 (hex) of a file's header, rest and each token block."""

    header: str
    rest: str
    blocks: tuple[str, ...]


def _hash_ranges(fd: int, ranges: Iterator[tuple[int, int]]) -> str:
    h = hashlib.sha256()
    for offset, n in ranges:
        done = 0
        while done < n:  # pieces of at most 8 MiB: a whole rest span may be large
            data = os.pread(fd, min(n - done, 8 << 20), offset + done)
            if not data:
                raise ValueError("the cache file ended early")
            h.update(data)
            done += len(data)
    return h.hexdigest()


def digests(fd: int, plan: Layout) -> Digests:
    """Every piece's sha256, read from an open file by pread (blocks on several threads)."""
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        blocks = pool.map(lambda k: _hash_ranges(fd, plan.block_ranges(k)), range(plan.blocks))
        rest = _hash_ranges(fd, plan.rest_ranges())
        return Digests(hashlib.sha256(plan.header).hexdigest(), rest, tuple(blocks))


def record_sha256(block_tokens: int, header: str, rest: str, blocks: list[str] | tuple[str, ...]) -> str:  # fmt: skip
    """The digest that ties a manifest's block record together (cache.blocks.record_sha256):
    sha256 of its other fields as one line of text."""
    text = f"{block_tokens} {header} {rest} {' '.join(blocks)}"
    return hashlib.sha256(text.encode()).hexdigest()


__all__ = [
    "Digests",
    "Layout",
    "Span",
    "assemble",
    "block_tokens",
    "digests",
    "header_layout",
    "record_sha256",
    "span",
]
