"""Push validated bundles to an OCI repository: only the blobs it lacks move, then one tag each.

Every blob of a bundle (small files, cache header, rest, token-range blocks) is checked with a
HEAD and uploaded only when missing, or mounted from another repository (`mount_from`) that has
it. The bundle's tag is put last, after all its blobs are in: a failure never leaves a tag
pointing at a partial artifact.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.distribute import oci
from pipeline.distribute.artifact import (
    BLOCK_TYPE,
    CONFIG_TYPE,
    FILE_TYPE,
    HEADER_TYPE,
    REST_TYPE,
    SMALL_FILES,
    Blob,
    config_record,
    manifest_body,
    tag_of,
)
from pipeline.distribute.blocks import Source, read_layout
from pipeline.distribute.checked import CheckedBundle
from pipeline.distribute.meter import Meter, Transfer
from pipeline.distribute.oci import Registry, in_parallel, parse_repo
from pipeline.distribute.oci_http import Body
from pipeline.distribute.pinned import Pinned
from pipeline.distribute.prehash import Prehash
from pipeline.format.bundle_folder import CACHE_FILE
from pipeline.format.errors import PipelineError


@dataclass(frozen=True)
class PushedArtifact:
    bundle: CheckedBundle
    tag: str
    digest: str
    total_bytes: int
    transfer: Transfer


@dataclass
class OciPushResult:
    repo: str
    artifacts: list[PushedArtifact] = field(default_factory=list)
    transfer: Transfer = field(default_factory=Transfer)


class _Uploader:
    """Puts blobs into the repository once each, counting what moved and what was there.
    Thread-safe: blocks go up several at a time (each blob costs the registry a few requests)."""

    def __init__(
        self, registry: Registry, mount_from: list[str], dry_run: bool, meter: Meter
    ) -> None:
        self.registry, self.mount_from, self.seen = registry, mount_from, set()
        self.dry_run = dry_run  # count what would move; upload and mount nothing
        self.meter = meter
        self.lock = threading.Lock()

    def put(
        self,
        media_type: str,
        data: Body,
        counts: Transfer,
        title: str | None = None,
        ahead: Callable[[], str | None] | None = None,
    ) -> Blob:
        """`data`: bytes, or buffers that are the blob one after another (views of the file);
        `ahead`: its digest as computed ahead (Prehash), or None to hash it here."""
        parts = [data] if isinstance(data, bytes) else data
        size = sum(len(p) for p in parts)
        with self.meter.phase("hash"):
            digest = ahead() if ahead is not None else None
            if digest is None:
                h = hashlib.sha256()
                for p in parts:
                    h.update(p)
                digest = "sha256:" + h.hexdigest()
        with self.lock:  # the first to claim a digest puts it; the others find it there
            claimed = digest not in self.seen
            self.seen.add(digest)
        with self.meter.phase("transfer"):
            there = not claimed or self._there(digest)
            if not there and not self.dry_run:
                self.registry.upload(digest, data)
        with self.lock:
            if there:
                counts.reused_bytes += size
                counts.reused_blobs += 1
            else:
                counts.moved_bytes += size
                counts.moved_blobs += 1
        self.meter.advance(size, reused=there)
        return Blob(media_type, digest, size, title)

    def _there(self, digest: str) -> bool:
        """Whether the repository has the blob, or now has it mounted from --mount-from."""
        if self.registry.has_blob(digest) is not None:
            return True
        return not self.dry_run and any(
            self.registry.mount(digest, source) for source in self.mount_from
        )


def push_oci(
    bundles: list[CheckedBundle],
    repo: str,
    *,
    mount_from: list[str] = (),
    plain_http: bool = False,
    ca_bundle: str | None = None,
    dry_run: bool = False,
    meter: Meter | None = None,
    prehash: Prehash | None = None,
) -> OciPushResult:
    """Upload each validated bundle's missing blobs, then tag it; `dry_run`: only ask the
    registry which blobs it has, and count what would move (nothing is uploaded, mounted or
    tagged; a blob --mount-from could mount counts as moving); `prehash`: block digests
    computed while the bundles were validated."""
    ref = parse_repo(repo)
    sources = [_same_host(ref, parse_repo(r)) for r in mount_from]
    registry = Registry(ref, plain_http=plain_http, ca_bundle=ca_bundle)
    result = OciPushResult(ref.url)
    meter = meter or Meter()
    try:
        uploader = _Uploader(registry, sources, dry_run, meter)
        for b in bundles:
            pushed = _push_one(registry, uploader, b, dry_run, prehash)
            result.artifacts.append(pushed)
            result.transfer.add(pushed.transfer)
    finally:
        registry.close()
    return result


def _same_host(ref, source) -> str:
    if source.host != ref.host:
        raise PipelineError(
            f"--mount-from {source.url}: a blob mount works within one registry ({ref.host}); "
            "name a repository on it"
        )
    return source.name


def _read(meter: Meter, read, *args) -> bytes:
    with meter.phase("read"):
        return read(*args)


def _check_manifest_size(
    b: CheckedBundle, tag: str, plan, files: dict[str, int], config_bytes: int, annotations: dict
) -> int:
    """The artifact's bytes, its manifest included; PipelineError, before any blob moves, when
    that manifest is over what a registry takes (its length is known exactly: every digest has
    the same length and every size is known). `files`: the small files' sizes by name."""
    zero = "sha256:" + "0" * 64
    layers = [Blob(FILE_TYPE, zero, n, f) for f, n in files.items()]
    layers += [Blob(HEADER_TYPE, zero, len(plan.header))]
    layers += [Blob(REST_TYPE, zero, sum(n for _, n in plan.rest_ranges()))]
    layers += [
        Blob(BLOCK_TYPE, zero, sum(n for _, n in plan.block_ranges(k))) for k in range(plan.blocks)
    ]
    size = len(manifest_body(Blob(CONFIG_TYPE, zero, config_bytes), layers, annotations))
    total = size + config_bytes + sum(x.size for x in layers)
    if size > oci.MAX_MANIFEST_BYTES:
        raise PipelineError(
            f"bundle {b.repo_path}: its artifact manifest ({tag}) would be {size:,} bytes for "
            f"{plan.blocks:,} blocks, over the {oci.MAX_MANIFEST_BYTES:,} a registry accepts; "
            "nothing was uploaded: split the prefix into smaller ones"
        )
    return total


def _push_one(
    registry: Registry,
    up: _Uploader,
    b: CheckedBundle,
    dry_run: bool = False,
    prehash: Prehash | None = None,
) -> PushedArtifact:
    """One bundle's blobs, read from the files the validator read (Pinned), then its tag."""
    files = [f for f in SMALL_FILES if f in b.files]
    pinned = Pinned(b.local, dict(b.ids), [*files, CACHE_FILE], f"{b.repo_path} ({b.local})")
    try:
        return _push_pinned(registry, up, b, pinned, files, dry_run, prehash)
    finally:
        pinned.close()


def _push_pinned(
    registry: Registry,
    up: _Uploader,
    b: CheckedBundle,
    pinned: Pinned,
    files: list[str],
    dry_run: bool,
    prehash: Prehash | None,
) -> PushedArtifact:
    name, version, folder = b.repo_path.split("/")
    tag = tag_of(name, int(version), folder)
    counts = Transfer()
    cache = pinned.fds[CACHE_FILE]
    try:
        plan = read_layout(cache, b.tokens, b.block_tokens)  # cut as manifest.json pins
    except ValueError as exc:
        raise PipelineError(
            f"bundle {b.repo_path} ({b.local}): {exc}; nothing was pushed"
        ) from None
    record = config_record(
        name, int(version), folder, b.tokens, plan.block_tokens, plan.file_bytes, b.cache_sha256
    )
    annotations = {
        "org.opencontainers.image.title": b.repo_path,
        "dev.mlx-prefix-bundles.prefix": f"{name}@{version}",
        "dev.mlx-prefix-bundles.cache-sha256": b.cache_sha256,
    }
    sizes = {f: pinned.size(f) for f in files}
    size = _check_manifest_size(b, tag, plan, sizes, len(record), annotations)  # before uploads
    up.meter.start(f"{name}@{version}", size)
    layers = [up.put(FILE_TYPE, pinned.read(f), counts, f) for f in files]
    layers.append(up.put(HEADER_TYPE, plan.header, counts))
    source = Source(cache, plan)
    try:
        layers.append(up.put(REST_TYPE, _read(up.meter, source.rest), counts))

        def block(k: int) -> Blob:
            ahead = None
            if prehash is not None:
                path, st = b.local / CACHE_FILE, os.fstat(cache)
                ahead = functools.partial(prehash.digest, path, plan, k, st)
            with source.views(k) as parts:  # read once, hashed and sent from one buffer
                return up.put(BLOCK_TYPE, parts, counts, ahead=ahead)

        layers += in_parallel(block, range(plan.blocks))  # in block order
    finally:
        source.close()
    config = up.put(CONFIG_TYPE, record, counts)
    body = manifest_body(config, layers, annotations)
    pinned.check()  # the files sent are still the ones validated: else the tag stays
    if dry_run:  # the digest the registry would give it: its manifest's bytes
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
    else:
        with up.meter.phase("transfer"):
            digest = registry.put_manifest(tag, body)  # last: every blob it names is in
    up.meter.finish()
    counts.moved_bytes += len(body)
    total = sum(x.size for x in layers) + config.size + len(body)
    return PushedArtifact(b, tag, digest, total, counts)
