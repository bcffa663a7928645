"""What proves a cache file block by block (format 5's cache.blocks), for the one validator: the
record describes this very file (its header pinned, its blocks tiling every byte), each piece
hashes to its pin, and a proof a writer hands in (a pull: each block checked as it landed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.format.bundle_folder import CACHE_FILE, refuse
from pipeline.format.cache_blocks import Digests, Layout, header_layout
from pipeline.format.fingerprint import sha256_bytes
from pipeline.format.manifest import BlocksInfo, Manifest
from pipeline.format.safetensors_read import Header, OpenFile


@dataclass(frozen=True)
class BlockProof:
    """A cache file whose every block its writer proved as it landed (a pull: each block's sha256,
    taken as it streamed, against the blocks manifest.json pins): `key` is the file's stat key
    (pipeline.format.memo.open_key) once written, `record_sha256` the cache.blocks record proven."""

    key: str
    record_sha256: str


def check_block_record(
    bundle: Path, manifest: Manifest, header: Header, f: OpenFile
) -> Layout | None:
    """cache.blocks (format 5) describes this file: its header is the one pinned, and the pinned
    block size cuts it into exactly the pinned number of blocks, header, rest and blocks tiling
    every byte (cheap: no data is read here; the data stage proves the bytes)."""
    blocks = manifest.cache.blocks
    if blocks is None:
        return None
    found = sha256_bytes(header.raw)
    if found != blocks.header_sha256:
        raise refuse(
            bundle,
            f"{CACHE_FILE}'s header hashes to {found[:12]}.., the manifest pins "
            f"{blocks.header_sha256[:12]}.. (cache.blocks.header_sha256); the bundle was altered: "
            "rebuild or re-copy it",
            "cache.blocks.header_sha256",
        )
    tokens = manifest.tokens.count
    try:
        plan = header_layout(header, tokens, f.stat.st_size, blocks.block_tokens)
    except ValueError as exc:
        raise refuse(bundle, f"{CACHE_FILE}: {exc}; rebuild the bundle", "cache.blocks") from None
    if plan.blocks != len(blocks.sha256):
        raise refuse(
            bundle,
            f"the manifest pins {len(blocks.sha256)} blocks of {blocks.block_tokens} tokens, "
            f"{CACHE_FILE} ({tokens} tokens) has {plan.blocks}; rebuild the bundle",
            "cache.blocks.sha256",
        )
    return plan


def check_pieces(bundle: Path, blocks: BlocksInfo, plan: Layout, found: Digests) -> None:
    """Every block and the rest hash to what the manifest pins (the first that does not named)."""
    pairs = [("rest", found.rest, blocks.rest_sha256, "cache.blocks.rest_sha256")]
    for k, (got, pinned) in enumerate(zip(found.blocks, blocks.sha256, strict=True)):
        t0 = k * plan.block_tokens
        t1 = min(t0 + plan.block_tokens, plan.tokens) - 1
        pairs.append((f"block {k} (tokens {t0}-{t1})", got, pinned, "cache.blocks.sha256"))
    for what, got, pinned, field in pairs:
        if got != pinned:
            raise refuse(
                bundle,
                f"{CACHE_FILE} {what} hashes to {got[:12]}.., the manifest pins {pinned[:12]}..; "
                "the bundle was altered: rebuild or re-copy it",
                field,
            )


__all__ = ["BlockProof", "check_block_record", "check_pieces"]
