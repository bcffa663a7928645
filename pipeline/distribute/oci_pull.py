"""Pull from an OCI repository: the bundles that fit a local model, checked at every step.

Per bundle, in this order: the artifact manifest against its digest; its config and small files
(each blob's digest and size checked while it streams); with trusted keys, the signature over
manifest.json before any large download; the tag, config and manifest.json naming the same
bundle (a swapped tag is refused here); with a format-5 manifest.json, the artifact's header,
rest and blocks the very ones it pins (cache.blocks: a re-made artifact is refused once its
header is read, before its rest or any block moves); then the cache file rebuilt from them, each block taken from a bundle already in the
destination folder when one has the same bytes, else downloaded, each checked by its sha256 as it
lands. Then the hub form's last steps: every target locked, the one validator, an atomic publish
of all or none (pipeline.distribute.publish.publish_staged). A format-5 file whose every piece
was proven so is not read again (validate's BlockProof); an older format's is checked against
the BLAKE3 its manifest.json pins, in the validator's one read of it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.builder.writer import clean_staging, discard, new_staging_folder
from pipeline.distribute.artifact import (
    ArtifactConfig,
    Blob,
    Parsed,
    parse_config,
    parse_manifest,
    parse_tag,
    tag_of,
)
from pipeline.distribute.blocks import Layout, Target, layout
from pipeline.distribute.local_bundles import LocalBlocks, up_to_date
from pipeline.distribute.meter import Meter, Transfer
from pipeline.distribute.oci import Registry, in_parallel, parse_repo
from pipeline.distribute.publish import PulledBundle, PullResult, disk_error, publish_staged
from pipeline.distribute.resume import Resume
from pipeline.distribute.selection import (
    RemoteBundle,
    check_found,
    near_model,
    parse_wanted,
    select,
)
from pipeline.format import memo
from pipeline.format.bundle_folder import (
    CACHE_FILE,
    FINGERPRINT_CHARS,
    MANIFEST_FILE,
    model_folder,
    read_manifest_bytes,
)
from pipeline.format.bundle_folder import parse_manifest as parse_bundle_manifest
from pipeline.format.bundle_signature import check_binding, check_signature
from pipeline.format.errors import BundleError, PipelineError
from pipeline.format.manifest import Manifest
from pipeline.format.served_identity import identity_for
from pipeline.format.signature import PublicKey
from pipeline.format.validate import BlockProof

NOTHING = "nothing was published"


def pull_oci(
    repo: str,
    model_dir: Path,
    bundles_dir: Path | None = None,
    prefixes: list[str] | None = None,
    trusted_keys: Sequence[PublicKey] = (),
    *,
    plain_http: bool = False,
    ca_bundle: str | None = None,
    meter: Meter | None = None,
    locked: dict[str, str | None] | None = None,
) -> PullResult:
    """Fetch, check, validate and publish the bundles of an OCI repo that fit `model_dir`;
    `locked` ({repo path: artifact digest or None}, pull.locked_selection): exactly those
    folders, each by its digest where the lockfile records one, else by its tag."""
    ref = parse_repo(repo)
    model_dir = Path(model_dir)
    root = Path(bundles_dir) if bundles_dir is not None else near_model(model_dir)
    wanted = parse_wanted(prefixes)
    # a bad model folder fails here, before the network (in this thread: a side thread that
    # imported mlx_lm while blocks streamed saved ~2 s, and aborted one bench pull at exit)
    meter = meter or Meter()
    with meter.phase("model identity"):  # its cache classes remembered: no import of mlx_lm
        identity = identity_for(model_dir)
    fingerprint = identity.model
    registry = Registry(ref, plain_http=plain_http, ca_bundle=ca_bundle)
    registry.meter = meter
    try:
        remote = [RemoteBundle(*p, ()) for t in registry.tags() if (p := parse_tag(t))]
        pins = {path: d for path, d in (locked or {}).items() if d is not None}
        for path in sorted(set(pins) - {b.path for b in remote}):  # pinned, its tag pruned
            remote.append(RemoteBundle(*_split(path), ()))
        result = PullResult(ref.url, None, None, None, model_dir, root)
        result.transfer = Transfer()
        chosen, result.skipped = select(remote, fingerprint, wanted, locked)
        check_found(result, chosen, wanted, fingerprint[:FINGERPRINT_CHARS], locked)
        result.by_tag = sorted(b.path for b in chosen if locked and b.path not in pins)
        clean_staging(root)
        staging = new_staging_folder(root)
        local, resume = LocalBlocks(root), Resume(root)
        proofs: dict[str, BlockProof] = {}  # the files whose every block was proven as it landed
        try:
            check = _Check(tuple(trusted_keys), identity, root)
            try:
                for b in chosen:
                    fetch = _Fetch(registry, b, staging / b.path, Transfer())
                    fetch.reference = pins.get(b.path, fetch.tag)
                    with meter.phase("fetch", cpu=True):  # its wall time, whatever the threads
                        result.digests[b.path] = fetch.run(check, local, resume)
                    if fetch.proof is not None:
                        proofs[b.path] = fetch.proof
                    result.transfers[b.path] = fetch.counts
                    result.transfer.add(fetch.counts)
                    if fetch.tokens is not None:  # the bundle here is this artifact's
                        result.current.append(
                            PulledBundle(b.name, b.version, b.path, root / b.path, fetch.tokens)
                        )
            except BaseException:  # the bundles that arrived whole are kept for the next pull
                for path, digest in result.digests.items():
                    if (staging / path).is_dir():
                        resume.keep(digest, staging / path / CACHE_FILE)
                raise
            stale = [b for b in chosen if b.path not in {c.repo_path for c in result.current}]
            with meter.phase("validate", cpu=True):  # the one validator, then the atomic publish
                # a file proven block by block is not read again; any other is checked against
                # the BLAKE3 manifest.json pins, in the validator's one read (no sha256 pass)
                keys = tuple(trusted_keys)
                publish_staged(result, stale, staging, identity, keys, True, proofs)
        except OSError as exc:  # a full disk, a read-only mount: name the folder, not "I/O"
            kept = f" (what arrived is kept in {resume.folder} for that pull)"
            if (local_error := disk_error(root, exc, kept)) is None:
                raise
            raise local_error from None
        finally:
            local.close()
            discard(root, staging)
            result.notes = [f"{p}: {why}" for p, why in sorted(local.unusable.items())]
        resume.clear()  # every artifact arrived whole: no partial file is worth keeping
    finally:
        registry.close()
    return result


def _split(path: str) -> tuple[str, int, str]:
    name, version, folder = path.split("/")
    return name, int(version), folder


@dataclass(frozen=True)
class _Check:
    """What decides that a bundle already here is up to date: the keys, the model, the folder."""

    keys: tuple[PublicKey, ...]
    identity: Any
    root: Path


class _Fetch:
    """One bundle's artifact into its staging folder."""

    def __init__(self, registry: Registry, b: RemoteBundle, dest: Path, counts: Transfer) -> None:
        self.registry, self.b, self.dest, self.counts = registry, b, dest, counts
        self.meter = registry.meter
        self.lock = threading.Lock()
        self.tag = tag_of(b.name, b.version, b.folder)
        self.reference = self.tag  # or the digest a lockfile pins
        self.tokens: int | None = None  # set when the bundle here is up to date
        self.proof: BlockProof | None = None  # set when every piece was proven against the pins

    @property
    def where(self) -> str:
        pinned = "tag" if self.reference == self.tag else "the lockfile's digest"
        repo = self.registry.ref.url
        return f"bundle {self.b.path} from registry repo {repo} ({pinned} {self.reference})"

    def fail(self, why: str) -> PipelineError:
        return PipelineError(f"{self.where}: {why}; {NOTHING}")

    def get(self, blob: Blob) -> bytes:
        with self.meter.phase("transfer"):
            data = self.registry.get_blob(blob.digest, blob.size)
        self.counts.moved_bytes += len(data)
        self.counts.moved_blobs += 1
        self.meter.advance(len(data))
        return data

    def run(self, check: _Check, local: LocalBlocks, resume: Resume) -> str:
        """The artifact's digest; its bundle staged in `dest`, or `tokens` set when the bundle
        already here is this artifact's (up to date: no blob moves)."""
        body, digest = self.registry.get_manifest(self.reference)  # a digest is checked
        self.counts.moved_bytes += len(body)
        parsed = parse_manifest(body, self.where)
        with self.meter.phase("up to date"):
            self.tokens = up_to_date(
                check.root / self.b.path, parsed.files, check.identity, check.keys
            )
        if self.tokens is not None:
            return digest
        keys = check.keys
        blobs = [parsed.config, *parsed.files, parsed.header, parsed.rest, *parsed.blocks]
        self.meter.start(f"{self.b.name}@{self.b.version}", sum(x.size for x in blobs))
        config = self._config(self.get(parsed.config))
        self.dest.mkdir(parents=True)
        for blob in parsed.files:
            (self.dest / blob.title).write_bytes(self.get(blob))
        manifest = self._manifest(keys, config)
        b = config.block_tokens
        header = self.get(parsed.header)
        try:
            plan = layout(header, manifest.tokens.count, manifest.cache.file_bytes, block_size=b)
        except ValueError as exc:
            raise self.fail(f"{exc}; push it again") from None
        if plan.blocks != len(parsed.blocks):
            raise self.fail(
                f"the artifact lists {len(parsed.blocks)} blocks of {b} tokens, its cache layout "
                f"{plan.blocks}; push it again"
            )
        self._pinned(manifest, config, parsed)  # before any block or the rest moves
        partial = self.dest / CACHE_FILE
        taken = resume.take(digest, partial, plan.file_bytes)  # an open descriptor, or None
        try:
            self._rebuild(digest, plan, parsed, local, Target(partial, plan, fd=taken))
        except BaseException:  # interrupted or refused: the blocks that arrived stay for later
            resume.keep(digest, partial)
            raise
        local.offer(partial, plan)  # every block checked: a source for the artifacts after it
        if manifest.cache.blocks is not None:  # each piece's sha256 was the one pinned
            st = os.stat(partial, follow_symlinks=False)
            key = memo.open_key(os.path.realpath(partial), st)
            self.proof = BlockProof(key, manifest.cache.blocks.record_sha256)
        self.meter.finish()
        return digest

    def _pinned(self, manifest: Manifest, config: ArtifactConfig, parsed: Parsed) -> None:
        """The artifact's block size, header, rest and blocks are the ones manifest.json pins
        (format 5), checked before the rest or any block moves: a registry cannot serve blocks
        other than those of a manifest.json it did not change (nor, with --trusted-key, of one
        it did)."""
        pins = manifest.cache.blocks
        if pins is None:
            return
        listed = [("block size", str(config.block_tokens), str(pins.block_tokens))]
        listed.append(("header", parsed.header.digest, "sha256:" + pins.header_sha256))
        listed.append(("rest", parsed.rest.digest, "sha256:" + pins.rest_sha256))
        if len(parsed.blocks) != len(pins.sha256):
            found, pinned = f"{len(parsed.blocks)} blocks", f"{len(pins.sha256)}"
            listed.append(("block count", found, pinned))
        for k, (blob, pin) in enumerate(zip(parsed.blocks, pins.sha256, strict=False)):
            listed.append((f"block {k}", blob.digest, "sha256:" + pin))
        for what, found, pinned in listed:
            if found != pinned:
                raise self.fail(
                    f"its {what} is {found[:19]}, its {MANIFEST_FILE} pins {pinned[:19]} "
                    "(cache.blocks): the artifact was re-made or altered; push the bundle again"
                )

    def _config(self, data: bytes) -> ArtifactConfig:
        try:
            config = parse_config(data)
        except ValueError as exc:
            raise self.fail(f"its config {exc}") from None
        found = (config.prefix, config.version, config.folder)
        if found != (self.b.name, self.b.version, self.b.folder):
            raise self.fail(
                f"the tag points at the artifact of {found[0]}/{found[1]}/{found[2]} (a swapped "
                "or re-pointed tag); push the bundle again"
            )
        return config

    def _manifest(self, keys: tuple[PublicKey, ...], config: ArtifactConfig) -> Manifest:
        """manifest.json: signed by a trusted key (when given), naming this bundle and file."""
        path = self.dest / MANIFEST_FILE
        if not path.exists():
            raise self.fail(f"the artifact has no {MANIFEST_FILE}; push the bundle again")
        try:
            data = read_manifest_bytes(self.dest, None)
            signature = check_signature(self.dest, data, keys) if keys else None
            manifest = parse_bundle_manifest(self.dest, data, kind="prefix")
            if signature is not None:
                check_binding(self.dest, signature, manifest)
        except BundleError as exc:  # its reason names the staging folder: name the bundle
            where = f"{self.b.name}/{self.b.version}/{self.b.folder}"
            why = exc.reason.replace(str(self.dest), where)
            if exc.field == "kind":  # a snapshot (or any other kind) pushed under a bundle tag
                why = f"{why.split(' (')[0]}: not a prefix bundle; push the bundle again"
            raise self.fail(why) from None
        m = manifest
        found = (m.prefix.name, m.prefix.version, model_folder(m.model.slug, m.model.fingerprint))
        if found != (self.b.name, self.b.version, self.b.folder):
            raise self.fail(
                f"its {MANIFEST_FILE} is the bundle {found[0]}/{found[1]}/{found[2]} (a swapped "
                "tag or artifact); push the bundle again"
            )
        pins = (m.cache.file_sha256, m.cache.file_bytes, m.tokens.count)
        if pins != (config.cache_sha256, config.file_bytes, config.tokens):
            raise self.fail(f"its config does not match its {MANIFEST_FILE}; push it again")
        return m

    def _rebuild(
        self, digest: str, plan: Layout, parsed, local: LocalBlocks, target: Target
    ) -> None:
        """Every piece in place, several at a time: from the partial file of an interrupted pull,
        a local bundle holding the same bytes, or the registry."""
        resumed = target.resumed

        def place(piece: tuple[int, Blob, list[tuple[int, int]]]) -> None:
            k, blob, ranges = piece
            with self.meter.phase("reuse"):
                here = (resumed and target.holds(ranges, blob.digest, blob.size)) or (
                    k >= 0 and local.fill(digest, plan, k, blob, target.writer(iter(ranges)))
                )
            if not here:
                self._stream(blob, ranges, target)
                return
            with self.lock:
                self.counts.reused_bytes += blob.size
                self.counts.reused_blobs += 1
            self.meter.advance(blob.size, reused=True)

        try:
            pieces = [(-1, parsed.rest, list(plan.rest_ranges()))]
            pieces += [(k, x, list(plan.block_ranges(k))) for k, x in enumerate(parsed.blocks)]
            in_parallel(place, pieces)
        finally:
            target.close()

    def _stream(self, blob: Blob, ranges: list[tuple[int, int]], target: Target) -> None:
        if sum(n for _, n in ranges) != blob.size:
            raise self.fail(
                f"blob {blob.digest[:19]} has {blob.size:,} bytes, its place another size"
            )
        with self.meter.phase("transfer"):
            self.registry.stream_blob(blob.digest, blob.size, target.writer(iter(ranges)))
        with self.lock:  # blobs stream in several at a time
            self.counts.moved_bytes += blob.size
            self.counts.moved_blobs += 1
        self.meter.advance(blob.size)
