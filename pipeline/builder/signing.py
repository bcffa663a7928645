"""Signing a bundle: manifest.json.minisig added atomically; no other file is rewritten.

The signature covers manifest.json's exact bytes (which pin the cache file, tokens and
fingerprints); its trusted comment binds prefix, version and model folder
(pipeline.format.bundle_signature.trusted_comment). A signature vouches for bytes, so it is only
put on bytes that were proven: integrity always, and an existing signature is never overwritten
silently (one that does not verify means the bundle changed after it was signed).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.format.bundle_folder import (
    CACHE_FILE,
    MANIFEST_FILE,
    SIGNATURE_FILE,
    parse_manifest,
    read_manifest,
    read_manifest_bytes,
    read_sums,
)
from pipeline.format.bundle_signature import (
    check_binding,
    check_signature,
    read_signature,
    trusted_comment,
)
from pipeline.format.errors import BuildError, BundleError
from pipeline.format.fingerprint import sha256_bytes
from pipeline.format.manifest import Manifest
from pipeline.format.safe_files import PUBLIC_FILE, publish_file
from pipeline.format.secret_key import SecretKey
from pipeline.format.signature import PublicKey, Signature
from pipeline.format.validate import recorded_identity, validate

# what to do when the signature cannot be written, by errno (else: the folder is not writable)
WRITE_FIXES = {
    errno.ENOSPC: "the disk is full: free space on it",
    errno.EDQUOT: "the disk quota is used up: free space in it",
    errno.EFBIG: "the file size limit was hit: raise it (ulimit -f)",
}


@dataclass(frozen=True)
class Signed:
    """What a signature put on a bundle vouches for, and what it replaced."""

    signature: Signature
    manifest: Manifest
    manifest_sha256: str
    already: bool = False  # a valid signature by this key was there: nothing was written
    replaced: str | None = None  # key id of the signature this one replaced

    def covers(self) -> str:
        """One line: the exact bytes the signature pins, and what was (not) checked of them."""
        m = self.manifest
        return (
            f"manifest.json sha256 {self.manifest_sha256[:16]}.., which pins {CACHE_FILE} sha256 "
            f"{m.cache.file_sha256[:16]}.. ({m.cache.file_bytes:,} bytes, {m.tokens.count:,} "
            f"tokens of {m.prefix.name} v{m.prefix.version}) for model {m.model.fingerprint[:12]}"
        )


def sign_manifest(bundle: Path, key: SecretKey, validated: str | None = None) -> Signature:
    """Sign the manifest.json that SHA256SUMS lists and put the signature beside it atomically.

    The caller has proven the bundle (sign_bundle checks integrity; the builder signs what it just
    wrote or rebuilt and compared); `validated`, the sha256 of the manifest bytes that proof read:
    other bytes read here (the file was replaced since) are refused, never signed.
    """
    bundle = Path(bundle)
    data = read_manifest_bytes(bundle, read_sums(bundle)[MANIFEST_FILE])
    if validated is not None and sha256_bytes(data) != validated:
        raise BundleError(
            str(bundle),
            f"{MANIFEST_FILE} changed after it was validated (sha256 {validated[:16]}.. "
            f"validated, {sha256_bytes(data)[:16]}.. now); nothing was signed: find what writes "
            "to this bundle, then sign it again",
            MANIFEST_FILE,
        )
    signature = key.sign(data, trusted_comment(parse_manifest(bundle, data)))
    write_signature(bundle, signature)
    return signature


def signed_by(bundle: Path, keys: Sequence[PublicKey]) -> bool:
    """True when manifest.json (as SHA256SUMS lists it) carries a valid signature by one of
    `keys`, made for this bundle. The caller has validated the bundle's integrity: the manifest
    pins every other byte, so the cache file is not hashed again here."""
    if not keys or not os.path.lexists(Path(bundle) / SIGNATURE_FILE):
        return False
    try:
        data = read_manifest_bytes(bundle, read_sums(bundle)[MANIFEST_FILE])
        sig = check_signature(bundle, data, keys)
        check_binding(bundle, sig, parse_manifest(bundle, data))
    except (BundleError, KeyError):
        return False
    return True


def sign_bundle(bundle: Path, key: SecretKey, *, replace: bool = False) -> Signed:
    """Validate a bundle's integrity (every byte hashed, once), then sign it; BundleError if
    refused.

    An existing signature by this key must verify (else the bundle changed since it was signed:
    refused, and left as it is); one by another key, or an unreadable one, is replaced only with
    `replace`.
    """
    bundle = Path(bundle)
    with _build_lock(bundle):
        v = validate(bundle, recorded_identity(read_manifest(bundle, None)))
        replaced = _existing_signature(bundle, key, replace)
        if replaced == key.public_key().id:
            return Signed(read_signature(bundle), v.manifest, v.manifest_sha256, already=True)
        sig = sign_manifest(bundle, key, v.manifest_sha256)  # the very bytes validated, or none
        return Signed(sig, v.manifest, v.manifest_sha256, replaced=replaced)


@contextlib.contextmanager
def _build_lock(bundle: Path) -> Iterator[None]:
    """The lock a build of this bundle holds (pipeline.builder.writer.target_lock), so that a
    build cannot swap the folder between the validation and the signature; a bundle outside a
    bundles tree a builder wrote (no .staging beside it) has no build to wait for."""
    from filelock import Timeout

    from pipeline.builder.writer import staging_root, target_lock

    root = bundle.absolute().parents[2] if len(bundle.absolute().parents) > 2 else None
    if root is None or not staging_root(root).is_dir():
        yield
        return
    try:
        with target_lock(root, bundle.absolute()):
            yield
    except Timeout:
        raise BuildError(
            f"{bundle}: a build is writing this bundle right now; sign it when the build is done"
        ) from None


def _existing_signature(bundle: Path, key: SecretKey, replace: bool) -> str | None:
    """The key id of the bundle's current signature (None: unsigned); BundleError when it must
    not be replaced: a signature by this key that does not verify, or another's without replace."""
    if not os.path.lexists(bundle / SIGNATURE_FILE):
        return None
    own = key.public_key()
    try:
        sig = read_signature(bundle)
    except BundleError as exc:
        if replace:
            return "unreadable"
        raise BundleError(
            str(bundle), f"{exc.reason}; pass --replace to sign over it", SIGNATURE_FILE
        ) from None
    if sig.key_id == own.key_id:
        if not signed_by(bundle, [own]):
            raise BundleError(
                str(bundle),
                f"its {SIGNATURE_FILE} by this key (id {sig.key}) does not verify: the bundle "
                "changed after it was signed; rebuild it with 'prefix-bundles build --force "
                "--sign-key KEY' instead of signing what is there",
                SIGNATURE_FILE,
            )
        return sig.key
    if not replace:
        raise BundleError(
            str(bundle),
            f"it is already signed by another key (id {sig.key}); pass --replace to put this "
            f"key's (id {own.id}) signature in its place",
            SIGNATURE_FILE,
        )
    return sig.key


def write_signature(bundle: Path, signature: Signature) -> None:
    """Write manifest.json.minisig with one rename, from a temporary file beside the bundle folder.

    The temporary file is outside the folder, so a server mounting meanwhile never sees a file
    that is not part of a bundle; an existing signature (another key, rotation) is replaced.
    """
    beside = bundle.parent / f".{bundle.name}.{SIGNATURE_FILE}"
    try:
        publish_file(bundle / SIGNATURE_FILE, signature.file_bytes(), PUBLIC_FILE, stage_as=beside)
    except OSError as exc:
        fix = WRITE_FIXES.get(exc.errno, "make the bundle's folder writable")
        raise BuildError(f"cannot write {bundle / SIGNATURE_FILE}: {exc.strerror}; {fix}") from None


__all__ = ["Signed", "sign_bundle", "sign_manifest", "signed_by", "write_signature"]
