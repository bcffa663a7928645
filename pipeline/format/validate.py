"""The one validator: whether a bundle is exactly right for a served model, or why not.

`verify`, `inspect`, `mount` and `serve` all call `validate`; none has checks of its own. Every
check runs before any tensor is handed out, and any failure, expected or not, is one BundleError
naming the bundle and the first problem.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.format import memo
from pipeline.format.block_proof import BlockProof, check_block_record, check_pieces
from pipeline.format.bundle_folder import (
    CACHE_FILE,
    LAYOUT_FOLDER,
    MANIFEST_FILE,
    SUMS_FILE,
    check_folder,
    check_kind,  # noqa: F401  (re-exported: it was defined here)
    digest_mismatch,
    model_folder,
    parse_manifest,
    read_manifest_bytes,
    read_sums,
    refuse,
)
from pipeline.format.bundle_signature import check_binding, check_signature
from pipeline.format.cache_blocks import Layout, digests
from pipeline.format.cache_codec import expected_file, rebuild, user_metadata
from pipeline.format.cache_header import (
    Expected,
    LayoutError,
    check_header,
    check_scalars,
    scalar_values,
)
from pipeline.format.compat import SUPPORTED_RANGE, installed_mlx_lm, layout_for, unsupported
from pipeline.format.errors import BundleError
from pipeline.format.fingerprint import ModelIdentity, ModelShape, canonical_json, sha256_bytes
from pipeline.format.identity import check_identity
from pipeline.format.manifest import Manifest
from pipeline.format.names import parse_version
from pipeline.format.safetensors_read import (
    FormatError,
    Header,
    OpenFile,
    open_file,
    read_data,
    read_header,
)
from pipeline.format.signature import PublicKey


@dataclass(frozen=True)
class Validated:
    """A bundle proven right for the served model; `cache` is set when it was loaded."""

    path: Path
    manifest: Manifest
    tokens: list[int]
    cache: list[Any] | None
    manifest_sha256: str = ""  # of the manifest bytes validated (they pin every other fact)


def validate(
    bundle: Path,
    identity: ModelIdentity,
    *,
    load: bool = False,
    trust_memo: bool = False,
    trusted_keys: Sequence[PublicKey] = (),
    kind: str = "prefix",
    manifest_only: bool = False,
    proof: BlockProof | None = None,
) -> Validated:
    """Check everything about a bundle for a model; load its cache when asked. BundleError if not.

    trust_memo lets a file this user already hashed in full, unchanged since by its stat, skip the
    re-hash (mount's restart path); verify passes False and always hashes in full. With
    trusted_keys (pipeline.format.signature.read_trusted_keys), the bundle must carry a valid
    signature by one of them. `kind`: "prefix" (a bundle) or "snapshot" (serve --snapshots); a
    manifest of the other kind is refused. `manifest_only`: stop before the cache file (no tensor
    read; `tokens` empty): a caller choosing what to load reads every manifest first. `proof`:
    the file's blocks were proven as it was written (BlockProof): when it is this file, unchanged,
    and the record this manifest pins, its bytes are not hashed again.
    """
    bundle = Path(bundle)
    stage = ["files"]
    keys = tuple(trusted_keys)
    try:
        return _validate(
            bundle, identity, load, trust_memo, stage, keys, kind, manifest_only, proof
        )
    except BundleError as exc:
        exc.check = stage[0]
        raise
    except LayoutError as exc:
        error = BundleError(str(bundle), f"{exc}; rebuild the bundle", exc.field)
    except PermissionError as exc:  # the bundle may be fine: this user cannot read it
        error = BundleError(
            str(bundle),
            f"cannot be read ({exc.strerror}: {exc.filename}); check its permissions (this user "
            "must be able to list the folder and read its files)",
        )
    except Exception as exc:  # anything else is still a refusal, never a crash of the caller
        detail = " ".join(str(exc).split())[:200]
        error = BundleError(
            str(bundle),
            f"cannot be validated ({exc.__class__.__name__}: {detail}); rebuild or re-copy it",
        )
    error.check = stage[0]
    raise error


def _validate(
    bundle: Path,
    identity: ModelIdentity,
    load: bool,
    trust_memo: bool,
    stage: list[str],
    trusted_keys: tuple[PublicKey, ...] = (),
    kind: str = "prefix",
    manifest_only: bool = False,
    proof: BlockProof | None = None,
) -> Validated:
    check_folder(bundle)
    stage[0] = "checksums"
    sums = read_sums(bundle)
    manifest_bytes = read_manifest_bytes(bundle, sums[MANIFEST_FILE])
    # --- signature (issue 18): over the bytes just read, before they are parsed ---
    signature = None
    if trusted_keys:
        stage[0] = "signature"
        signature = check_signature(bundle, manifest_bytes, trusted_keys)
    stage[0] = "manifest"
    manifest = parse_manifest(bundle, manifest_bytes, kind)  # of the kind asked for
    if signature is not None:
        check_binding(bundle, signature, manifest)
    # --- end signature ---
    stage[0] = "location"
    check_location(bundle, manifest)
    stage[0] = "mlx-lm"
    check_runtime(bundle, manifest)
    stage[0] = "identity"
    check_identity(bundle, manifest, identity)
    if manifest_only:
        return Validated(bundle, manifest, [], None, sums[MANIFEST_FILE])
    stage[0] = "cache file"
    with _open_cache(bundle) as cache_file:  # one open file: its stat, header, load and hash
        _check_cache_record(bundle, manifest, sums[CACHE_FILE], cache_file)
        stage[0] = "layout"
        header, expected = _check_cache_header(bundle, manifest, identity.shape, cache_file)
        plan = check_block_record(bundle, manifest, header, cache_file)
        stage[0] = "tokens"
        tokens = _check_tokens(bundle, header, manifest, identity.shape)
        stage[0] = "data"
        read = _Read(load, trust_memo, proof, plan)
        data = _read_cache(bundle, header, manifest, read, cache_file)
    check_scalars(scalar_values(header, data.small, expected), expected)
    c = manifest.cache
    cache = rebuild(data.arrays, header.metadata, c.layout, c.classes) if load else None
    return Validated(bundle, manifest, tokens, cache, sums[MANIFEST_FILE])


def recorded_identity(manifest: Manifest) -> ModelIdentity:
    """The identity a bundle says it was built for: checks its integrity without a model folder."""
    m = manifest.model
    shape = ModelShape(len(manifest.cache.classes), None, None, None, None, None)
    return ModelIdentity(m.fingerprint, m.tokenizer_fingerprint, m.template_sha256, shape)


# What `validate` establishes, in order (inspect prints these for a bundle that passes).
CHECKS = (
    ("files", "only SHA256SUMS, manifest.json, cache.safetensors (+ build-report.json, manifest.json.minisig), all regular files"),
    ("checksums", "SHA256SUMS lists both files; manifest.json matches it"),
    ("signature", "with trusted keys: manifest.json.minisig by one of them verifies over manifest.json's bytes"),
    ("manifest", "manifest.json fits the strict schema and is of the kind asked for (prefix or snapshot); a signature's trusted comment names this prefix, version and model"),
    ("location", "a folder in the <name>/<version>/<slug>-<fp> layout is where its manifest says"),
    ("mlx-lm", "the bundle's and the installed mlx-lm are supported; the cache-file layout is the builder's"),
    ("identity", "model weights/config, tokenizer and chat template fingerprints match"),
    ("cache file", "SHA256SUMS and the manifest agree on its sha256; its size is as recorded"),
    ("layout", "every tensor's dtype and shape, layer count and metadata as manifest and model require; format 5: the header is the one cache.blocks pins, and its blocks tile the file"),
    ("tokens", "token ids are in the vocabulary and hash to the manifest's ids_sha256"),
    ("data", "every byte hashes to the recorded digests (verify: every pinned block too); offsets and quantization scalars as required"),
)  # fmt: skip


def check_location(bundle: Path, manifest: Manifest) -> None:
    """A bundle kept in the layout <name>/<version>/<slug>-<fp12> must sit where its manifest says.

    A renamed or misplaced folder would otherwise pass for another version or model. A bundle
    copied anywhere else (no such layout) is judged by its contents alone.
    """
    path = Path(os.path.abspath(bundle))
    if manifest.prefix is None or not (
        LAYOUT_FOLDER.match(path.name) and parse_version(path.parent.name) is not None
    ):
        return
    m = manifest
    want = (m.prefix.name, str(m.prefix.version), model_folder(m.model.slug, m.model.fingerprint))
    found = (path.parent.parent.name, path.parent.name, path.name)
    if want != found:
        raise refuse(
            bundle,
            f"the folder is {'/'.join(found)} but the manifest is for {'/'.join(want)} (a renamed "
            f"or misplaced bundle); move it back to <bundles>/{'/'.join(want)} or rebuild it",
            "location",
        )


def check_runtime(bundle: Path, manifest: Manifest) -> None:
    """Refuse a bundle this installation cannot load faithfully (either layout loads anywhere)."""
    installed = installed_mlx_lm()
    if layout_for(installed) is None:
        raise refuse(bundle, unsupported(installed), "builder.mlx_lm")
    built = layout_for(manifest.builder.mlx_lm)
    if built is None:
        raise refuse(
            bundle,
            f"it was built with mlx-lm {manifest.builder.mlx_lm}, outside the supported range "
            f"{SUPPORTED_RANGE}; rebuild it under a supported mlx-lm",
            "builder.mlx_lm",
        )
    if manifest.kind == "snapshot" and manifest.builder.mlx_lm != installed:
        raise refuse(
            bundle,
            f"the snapshot was written under mlx-lm {manifest.builder.mlx_lm}, this is "
            f"{installed}: a snapshot is used only by the library that wrote it (serve writes a "
            "new one at its next stop)",
            "builder.mlx_lm",
        )
    if manifest.cache.layout != built:
        raise refuse(
            bundle,
            f"cache.layout {manifest.cache.layout} is not the layout mlx-lm "
            f"{manifest.builder.mlx_lm} writes ({built}); rebuild the bundle",
            "cache.layout",
        )


@contextmanager
def _open_cache(bundle: Path) -> Iterator[OpenFile]:
    """The cache file, opened once (no link followed); every later check reads this open file."""
    try:
        with open_file(bundle / CACHE_FILE) as opened:
            yield opened
    except FormatError as exc:
        raise refuse(bundle, f"{CACHE_FILE} {exc}", CACHE_FILE) from None


def _check_cache_record(
    bundle: Path, manifest: Manifest, listed_sha256: str, cache_file: OpenFile
) -> None:
    """SHA256SUMS and the manifest agree on the cache file, and its size is as recorded."""
    c = manifest.cache
    if listed_sha256 != c.file_sha256:
        raise refuse(
            bundle,
            f"{SUMS_FILE} lists {CACHE_FILE} as {listed_sha256[:12]}.. but the manifest records "
            f"{c.file_sha256[:12]}..; the bundle was altered: rebuild or re-copy it",
            "cache.file_sha256",
        )
    size = cache_file.stat.st_size
    if size != c.file_bytes:
        raise refuse(
            bundle,
            f"{CACHE_FILE} is {size:,} bytes but the manifest records {c.file_bytes:,} "
            "(truncated or replaced); rebuild or re-copy it",
            "cache.file_bytes",
        )


def _check_cache_header(
    bundle: Path, manifest: Manifest, shape: ModelShape, cache_file: OpenFile
) -> tuple[Header, Expected]:
    """The safetensors header, parsed by the library, exactly as the manifest and model require."""
    try:
        header = read_header(cache_file)
    except FormatError as exc:
        raise refuse(
            bundle, f"{CACHE_FILE} is not a valid safetensors file ({exc})", CACHE_FILE
        ) from None
    expected = expected_file(manifest, shape, header)
    check_header(header, expected, manifest)
    return header, expected


def _check_tokens(bundle: Path, header: Header, manifest: Manifest, shape: ModelShape) -> list[int]:
    """The token ids in the file: canonical JSON ints in the vocabulary, as the manifest hashes them."""
    raw = user_metadata(header.metadata, manifest.cache.layout)["token_ids"]
    tokens = json.loads(raw)
    vocab = shape.vocab_size or (1 << 31)
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab for t in tokens):
        raise refuse(
            bundle, f"token ids are not a list of ids below the vocabulary size {vocab}", "tokens"
        )
    if (
        canonical_json(tokens) != raw.encode()
        or sha256_bytes(raw.encode()) != manifest.tokens.ids_sha256
    ):
        raise refuse(
            bundle, "token ids in cache.safetensors do not match the manifest", "tokens.ids_sha256"
        )
    if len(tokens) != manifest.tokens.count:
        raise refuse(
            bundle,
            f"{len(tokens)} token ids in cache.safetensors, the manifest records {manifest.tokens.count}",
            "tokens.count",
        )
    return tokens


@dataclass(frozen=True)
class _Read:
    """How the data stage proves the bytes: load them or not, trust the memo or not, a proof
    handed in, and the block layout when the manifest pins blocks."""

    load: bool
    trust_memo: bool
    proof: BlockProof | None
    plan: Layout | None


def _read_cache(bundle: Path, header: Header, manifest: Manifest, read: _Read, f: OpenFile):
    """One pass over the cache file, checked against the manifest's BLAKE3 pin (all cores); a full
    verification (trust_memo False: verify, verify_full) checks its sha256 and every pinned block
    too. On a restart the memo may vouch for an unchanged file instead: the key is the open file's
    own fstat, and the file must still have it after the read (an in-place write in between
    changes its ctime). A file whose blocks its writer proved (`read.proof`: a pull) is not
    hashed again when the proof is of this file, unchanged, and of the blocks this manifest pins."""
    c = manifest.cache
    key = memo.open_key(f.real_path(), f.stat)
    proven = (
        read.proof is not None
        and c.blocks is not None
        and read.proof == BlockProof(key, c.blocks.record_sha256)
    )
    known = proven or (read.trust_memo and memo.lookup(key) == c.file_blake3)
    full = not read.trust_memo
    algorithms = () if known else ("blake3", "sha256") if full else ("blake3",)
    pool = ThreadPoolExecutor(1)  # a full check hashes the blocks beside the whole-file pass
    hash_pieces = full and not known and read.plan is not None
    pieces = pool.submit(digests, f.fd, read.plan) if hash_pieces else None
    try:
        data = read_data(f, header, digests=algorithms, load=read.load)
        found_pieces = pieces.result() if pieces is not None else None
    except (FormatError, ValueError) as exc:
        raise refuse(bundle, f"{CACHE_FILE} cannot be read ({exc})", CACHE_FILE) from None
    finally:
        pool.shutdown(wait=True)
    if memo.open_key(f.real_path(), f.restat()).split("|", 1)[1] != key.split("|", 1)[1]:
        raise refuse(
            bundle, f"{CACHE_FILE} changed while it was being read; mount again", CACHE_FILE
        )
    for algorithm, expected in (("blake3", c.file_blake3), ("sha256", c.file_sha256)):
        found = data.digests.get(algorithm)
        if found is not None and found != expected:
            raise digest_mismatch(bundle, CACHE_FILE, expected, found, algorithm)
    if found_pieces is not None and c.blocks is not None and read.plan is not None:
        check_pieces(bundle, c.blocks, read.plan, found_pieces)
    if not known:
        memo.store(key, data.digests["blake3"])
    return data


__all__ = ["CHECKS", "BlockProof", "Validated", "recorded_identity", "validate"]
