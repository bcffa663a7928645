"""The one bundle writer, beside the one validator: a bundle's files written into a new folder.

The cache file (the installed mlx-lm's layout, the token ids in its metadata), its block record
for the manifest (format 5, `block_record`), then manifest.json,
SHA256SUMS over both and, when given, the signature (manifest.json.minisig) and the build report;
each file new (never through a link), synced with its folder. The builder writes bundles with it
into its staging folder, serve writes snapshots (owner-only files) into a set being staged; each
publishes the folder its own way (pipeline.builder.writer, pipeline.runtime.snapshot_store).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.format.bundle_folder import (
    CACHE_FILE,
    MANIFEST_FILE,
    REPORT_FILE,
    SIGNATURE_FILE,
    SUMS_FILE,
    sums_text,
)
from pipeline.format.bundle_signature import trusted_comment
from pipeline.format.cache_blocks import digests, header_layout
from pipeline.format.cache_codec import write_cache
from pipeline.format.errors import BuildError
from pipeline.format.fingerprint import FileDigests, canonical_json, file_digests, sha256_bytes
from pipeline.format.manifest import MAX_BLOCKS, BlocksInfo, Manifest, blocks_info, manifest_bytes
from pipeline.format.safe_files import PRIVATE_FILE, PUBLIC_FILE, sync_path, write_new
from pipeline.format.safetensors_read import open_file, read_header


def write_cache_file(
    folder: Path,
    cache: list[Any],
    tokens: list[int],
    metadata: dict[str, str],
    digest: Callable[[Path], FileDigests] = file_digests,
) -> tuple[FileDigests, str]:
    """cache.safetensors in `folder` with the token ids in its metadata; (its digests, as
    `digest` reads them back, and the layout written, for the manifest)."""
    user = {**metadata, "token_ids": canonical_json(tokens).decode()}
    layout = write_cache(folder / CACHE_FILE, cache, user)
    return digest(folder / CACHE_FILE), layout


def block_record(cache_file: Path, tokens: int) -> BlocksInfo:
    """cache.blocks (format 5) of a cache file just written: the sha256 of its header, its rest
    and each token-range block (B by the rule), read back on several threads."""
    with open_file(cache_file) as opened:
        header = read_header(opened)
        plan = header_layout(header, tokens, opened.stat.st_size, None)
        if plan.blocks > MAX_BLOCKS:  # the manifest could not pin them: one line, nothing written
            raise BuildError(too_many_blocks(tokens, plan.block_tokens, plan.blocks))
        found = digests(opened.fd, plan)
    return blocks_info(plan.block_tokens, found.header, found.rest, list(found.blocks))


def too_many_blocks(tokens: int, block_tokens: int, blocks: int) -> str:
    """Why a prefix of `tokens` cut into `blocks` blocks of `block_tokens` cannot be a bundle."""
    return (
        f"the prefix is {tokens:,} tokens: {blocks:,} cache blocks of {block_tokens} tokens, and a "
        f"manifest pins at most {MAX_BLOCKS:,} (cache.blocks, format 5); shorten the included "
        f"documents or split the prefix (at most {MAX_BLOCKS * block_tokens:,} tokens here)"
    )


def write_bundle_files(
    folder: Path,
    manifest: Manifest,
    cache_digests: FileDigests,
    *,
    key: Any = None,
    report: dict[str, Any] | None = None,
    private: bool = False,
) -> bytes:
    """manifest.json, SHA256SUMS over it and the cache file, the signature by `key` (a
    format.secret_key.SecretKey) and build-report.json when given; `private`: every file of
    the folder owner-only. Everything synced; the manifest's bytes are returned."""
    data = manifest_bytes(manifest)
    files = {
        MANIFEST_FILE: data,
        SUMS_FILE: sums_text(
            {CACHE_FILE: cache_digests.sha256, MANIFEST_FILE: sha256_bytes(data)}
        ).encode(),
    }
    if key is not None:
        files[SIGNATURE_FILE] = key.sign(data, trusted_comment(manifest)).file_bytes()
    if report is not None:
        files[REPORT_FILE] = (json.dumps(report, sort_keys=True, indent=2) + "\n").encode()
    for name, content in files.items():
        write_new(folder / name, content, PRIVATE_FILE if private else PUBLIC_FILE)
    if private:  # the cache file is mlx's to create: its mode is set here
        (folder / CACHE_FILE).chmod(PRIVATE_FILE)
    sync_path(folder / CACHE_FILE, strict=True)
    sync_path(folder)  # its entries too: a power loss after the folder's publish keeps them
    return data


__all__ = ["block_record", "write_bundle_files", "write_cache_file"]
