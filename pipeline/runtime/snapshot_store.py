"""Runtime snapshots on disk (`serve --snapshots DIR`): one serve per folder (a file lock), sets
written whole or not at all, read back through the one validator with the host key.

DIR/
  .lock                       flock held by the serve process using DIR
  set-<N>/<rank>-<id16>/      the current set: one snapshot per folder, in the bundle format
                              (cache.safetensors, manifest.json of kind "snapshot", SHA256SUMS,
                              manifest.json.minisig by the host key)
  .staging-<pid>-<ns>/        a set being written; renamed to set-<N+1> once complete

A set appears by one rename; older sets and staging leftovers (a crash, a stop cut short) are
removed at the next start or save, so a half-written set is never read.
"""

from __future__ import annotations

import errno
import os
import platform
import re
import shutil
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import __version__
from pipeline.format.bundle_folder import (
    CACHE_FILE,
    MANIFEST_FILE,
    SIGNATURE_FILE,
    SUMS_FILE,
    sums_text,
)
from pipeline.format.bundle_signature import trusted_comment
from pipeline.format.cache_codec import write_cache
from pipeline.format.errors import BundleError, PipelineError
from pipeline.format.fingerprint import (
    ModelIdentity,
    canonical_json,
    file_digests,
    sha256_bytes,
)
from pipeline.format.manifest import (
    FORMAT_VERSION,
    BuilderInfo,
    CacheInfo,
    FidelityInfo,
    Manifest,
    ModelInfo,
    SnapshotInfo,
    TokenInfo,
    manifest_bytes,
)
from pipeline.format.validate import Validated, validate
from pipeline.runtime.prompt_cache import fork_cache

LOCK_FILE = ".lock"
SET_NAME = re.compile(r"^set-([1-9][0-9]{0,8})\Z")
STAGING_PREFIX = ".staging-"


@dataclass(frozen=True)
class Entry:
    """One prompt-cache entry to save: what a server hook lists, hottest first."""

    tokens: list[int]  # exactly the tokens the cache holds
    cache: list[Any]
    source: str  # how it was produced, e.g. "mlx_lm.server prompt cache (assistant)"
    lossy: bool  # continues quantized KV (recorded on the snapshot, never recomputed)
    continued_from: str | None = None  # NAME@VERSION of a bundle covering its opening


@dataclass(frozen=True)
class Context:
    """What every snapshot of one serve process records: server, model and library identity."""

    server: str  # manifest ServerName ("mlx-lm")
    identity: ModelIdentity
    slug: str
    template_source: str


class SnapshotFolder:
    """DIR, owner-only and locked by this process for as long as it lives."""

    def __init__(self, root: Path) -> None:
        import fcntl

        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(self.root)
        if st.st_uid != os.getuid():
            raise PipelineError(
                f"--snapshots {self.root} belongs to uid {st.st_uid}, not this user; give serve "
                "a folder of its own"
            )
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(self.root, 0o700)  # snapshots hold client prompts: owner-only
        self._lock = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._lock)
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            raise PipelineError(
                f"--snapshots {self.root} is in use by another serve process (it holds "
                f"{self.root / LOCK_FILE}); give each serve its own snapshot folder"
            ) from None

    def close(self) -> None:
        """Release the folder (the process's exit does it too)."""
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1

    def sets(self) -> list[tuple[int, Path]]:
        """The complete sets in the folder, newest first."""
        found = [(int(m[1]), p) for p in self.root.iterdir() if (m := SET_NAME.match(p.name))]
        return sorted(found, reverse=True)

    def current(self) -> Path | None:
        """The newest complete set, if any."""
        sets = self.sets()
        return sets[0][1] if sets else None

    def tidy(self) -> None:
        """Remove staging leftovers and every set but the newest (this process holds the lock)."""
        for path in self.root.iterdir():
            if path.name.startswith(STAGING_PREFIX):
                shutil.rmtree(path, ignore_errors=True)
        for _, path in self.sets()[1:]:
            shutil.rmtree(path, ignore_errors=True)

    def wipe(self) -> list[Path]:
        """Remove every set and staging leftover (this process holds the lock: no serve uses the
        folder); return what was removed."""
        gone = [
            p
            for p in self.root.iterdir()
            if SET_NAME.match(p.name) or p.name.startswith(STAGING_PREFIX)
        ]
        for path in gone:
            shutil.rmtree(path)
        return gone

    def write_set(self, entries: Sequence[Entry], context: Context, key: Any) -> Path:
        """Write `entries` (hottest first) as the new set, signed with `key`; the previous set
        stays until the new one is complete, then is removed."""
        number = (self.sets() or [(0, None)])[0][0] + 1
        staging = self.root / f"{STAGING_PREFIX}{os.getpid()}-{time.monotonic_ns()}"
        staging.mkdir(mode=0o700)
        try:
            for rank, entry in enumerate(entries):
                write_snapshot(staging, rank, entry, context, key)
            _fsync(staging)
        except BaseException:  # a full disk, a stop cut short: the previous set stays alone
            shutil.rmtree(staging, ignore_errors=True)
            raise
        final = self.root / f"set-{number}"
        os.rename(staging, final)
        _fsync(self.root)
        self.tidy()
        return final


def write_snapshot(parent: Path, rank: int, entry: Entry, context: Context, key: Any) -> Path:
    """One snapshot folder in the bundle format, signed; its files owner-only."""
    ids = canonical_json(entry.tokens)
    snapshot_id = sha256_bytes(
        canonical_json([context.identity.model, context.identity.template, sha256_bytes(ids)])
    )
    folder = parent / f"{rank:02d}-{snapshot_id[:16]}"
    folder.mkdir(mode=0o700)
    metadata = {"model": context.slug, "tokenizer_config": "{}", "token_ids": ids.decode()}
    # a KVCache's buffer runs past its offset: save new handles cut to it (nothing is copied)
    layout = write_cache(folder / CACHE_FILE, fork_cache(list(entry.cache)), metadata)
    digests = file_digests(folder / CACHE_FILE)
    manifest = snapshot_manifest(rank, entry, context, snapshot_id, digests, layout)
    data = manifest_bytes(manifest)
    (folder / MANIFEST_FILE).write_bytes(data)
    sums = {CACHE_FILE: digests.sha256, MANIFEST_FILE: sha256_bytes(data)}
    (folder / SUMS_FILE).write_text(sums_text(sums))
    signature = key.sign(data, trusted_comment(manifest))
    (folder / SIGNATURE_FILE).write_bytes(signature.file_bytes())
    for name in (CACHE_FILE, MANIFEST_FILE, SUMS_FILE, SIGNATURE_FILE):
        os.chmod(folder / name, 0o600)
        _fsync(folder / name)
    return folder


def snapshot_manifest(
    rank: int, entry: Entry, context: Context, snapshot_id: str, digests: Any, layout: str
) -> Manifest:
    """The manifest of one snapshot: kind "snapshot", the identity and library it is valid for."""
    import mlx.core as mx

    from pipeline.format.compat import installed_mlx_lm

    ident, kv = context.identity, cache_facts(entry.cache)
    count = len(entry.tokens)
    return Manifest(
        format_version=FORMAT_VERSION,
        kind="snapshot",
        tokens=TokenInfo(
            count=count,
            ids_sha256=sha256_bytes(canonical_json(entry.tokens)),
            rendered_tokens=count,
            stable_tokens=count,
        ),
        model=ModelInfo(
            slug=context.slug,
            fingerprint=ident.model,
            tokenizer_fingerprint=ident.tokenizer,
            template_sha256=ident.template,
            template_source=context.template_source,
        ),
        cache=CacheInfo(
            classes=kv["classes"],
            dtype=kv["dtype"],
            kv_bits=kv["bits"],
            kv_group_size=kv["group_size"],
            prefill_step_size=2048,  # not used for the KV classes a snapshot may hold
            nbytes=kv["nbytes"],
            file_sha256=digests.sha256,
            file_blake3=digests.blake3,
            file_bytes=digests.size,
            layout=layout,
        ),
        builder=BuilderInfo(
            pipeline=__version__,
            mlx=mx.__version__,
            mlx_lm=installed_mlx_lm(),
            platform=f"{platform.system()} {platform.machine()} python{platform.python_version()}",
            device=str(mx.default_device()),
            compute_dtype=kv["dtype"],
            kernels=f"serve {context.server}: the server's own prefill",
        ),
        fidelity=FidelityInfo(checked=False),
        build_key=snapshot_id,
        snapshot=SnapshotInfo(
            server=context.server,
            source=entry.source,
            lossy=entry.lossy,
            continued_from=entry.continued_from,
            rank=rank,
        ),
    )


SAVED_CLASSES = ("KVCache", "QuantizedKVCache")


def cache_facts(cache: Sequence[Any]) -> dict[str, Any]:
    """Classes, KV dtype, quantization and array bytes of a cache of KVCache/QuantizedKVCache
    layers (PipelineError for another kind: their file form depends on how they were filled)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    classes = [type(layer).__name__ for layer in cache]
    if not set(classes) <= set(SAVED_CLASSES):
        raise PipelineError(
            f"a prompt-cache entry with {sorted(set(classes) - set(SAVED_CLASSES))} layers is "
            "not saved as a snapshot (only KVCache and QuantizedKVCache are, so far)"
        )
    state = [layer.state for layer in fork_cache(list(cache))]  # KV buffers cut to the offset
    arrays = [a for _, a in tree_flatten(state) if isinstance(a, mx.array)]
    quantized = [layer for layer in cache if hasattr(layer, "bits")]
    floats = [a for a in arrays if "float" in str(a.dtype)]
    return {
        "classes": classes,
        "dtype": str(floats[0].dtype).removeprefix("mlx.core."),
        "bits": quantized[0].bits if quantized else None,
        "group_size": quantized[0].group_size if quantized else 64,
        "nbytes": sum(a.nbytes for a in arrays),
    }


def read_set(
    folder: Path, identity: ModelIdentity, public_key: Any
) -> tuple[list[Validated], list[BundleError]]:
    """Every snapshot of a set through the one validator, signed by the host key only; the
    refused ones with their reasons."""
    mounted, refused = [], []
    for path in sorted(p for p in folder.iterdir()):
        try:
            mounted.append(
                validate(path, identity, load=True, trusted_keys=(public_key,), kind="snapshot")
            )
        except BundleError as exc:
            refused.append(exc)
    return mounted, refused


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["Context", "Entry", "SnapshotFolder", "cache_facts", "read_set", "write_snapshot"]
