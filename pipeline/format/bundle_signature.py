"""A bundle's signature: manifest.json.minisig, by a trusted key, over manifest.json's exact bytes.

The manifest pins everything else (the cache file's sha256, BLAKE3 and size, token ids, model,
tokenizer and template fingerprints, name, version), so one signature covers the whole bundle. Its
trusted comment binds prefix, version and model folder: `prefix-bundles shop@2 tiny-c01d20cbb3fb`.
The validator's "signature" stage calls `check_signature` on the bytes it read and then parses.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.format.bundle_folder import MANIFEST_FILE, SIGNATURE_FILE, model_folder, refuse
from pipeline.format.errors import BundleError
from pipeline.format.manifest import Manifest
from pipeline.format.regular_files import FileProblem, read_regular
from pipeline.format.signature import (
    MAX_SIGNATURE_FILE_BYTES,
    PublicKey,
    Signature,
    check,
    parse_signature,
)

COMMENT_PROGRAM = "prefix-bundles"


def trusted_comment(manifest: Manifest) -> str:
    """The trusted comment a bundle's signature carries: program, name@version, model folder."""
    m = manifest
    folder = model_folder(m.model.slug, m.model.fingerprint)
    if m.prefix is None:  # a runtime snapshot: its build key names it
        return f"{COMMENT_PROGRAM} snapshot:{m.build_key[:16]} {folder}"
    return f"{COMMENT_PROGRAM} {m.prefix.name}@{m.prefix.version} {folder}"


def _key_ids(keys: Sequence[PublicKey]) -> str:
    return ", ".join(k.id for k in keys)


def read_signature(bundle: Path, keys: Sequence[PublicKey] = ()) -> Signature:
    """The bundle's parsed signature file; BundleError when missing or malformed."""
    path = Path(bundle) / SIGNATURE_FILE
    trusted = f" (trusted key id {_key_ids(keys)})" if keys else ""
    if not os.path.lexists(path):
        raise refuse(
            bundle,
            f"{SIGNATURE_FILE} is missing: every bundle must be signed by a trusted key{trusted}; "
            f"sign it ('prefix-bundles sign {bundle} --key KEY') or re-copy it with its signature",
            SIGNATURE_FILE,
        )
    try:
        return parse_signature(read_regular(path, MAX_SIGNATURE_FILE_BYTES))
    except FileProblem as exc:
        raise refuse(
            bundle, f"{SIGNATURE_FILE} {exc}{trusted}; re-copy the bundle", SIGNATURE_FILE
        ) from None
    except ValueError as exc:
        raise refuse(
            bundle,
            f"{SIGNATURE_FILE} is not a minisign signature ({exc}){trusted}; sign the bundle "
            "again or re-copy it",
            SIGNATURE_FILE,
        ) from None


def check_signature(bundle: Path, manifest_bytes: bytes, keys: Sequence[PublicKey]) -> Signature:
    """The signature verifies over `manifest_bytes` with one of `keys`; BundleError naming the key id."""
    sig = read_signature(bundle, keys)
    candidates = [k for k in keys if k.key_id == sig.key_id]
    if not candidates:
        raise refuse(
            bundle,
            f"{SIGNATURE_FILE} is signed by key id {sig.key}, which is not trusted (trusted key "
            f"id {_key_ids(keys)}); sign it with a trusted key, or trust that key's .pub file "
            "with --trusted-key if it is yours",
            SIGNATURE_FILE,
        )
    reasons = [check(sig, manifest_bytes, key) for key in candidates]
    if all(reasons):
        raise refuse(
            bundle,
            f"{SIGNATURE_FILE} by key id {sig.key} does not verify over {MANIFEST_FILE}: "
            f"{reasons[0]}; rebuild and sign the bundle again, or re-copy it",
            SIGNATURE_FILE,
        )
    return sig


def check_binding(bundle: Path, sig: Signature, manifest: Manifest) -> None:
    """The signature's trusted comment names this bundle's prefix, version and model folder."""
    want = trusted_comment(manifest)
    if sig.trusted_comment != want:
        raise refuse(
            bundle,
            f"the trusted comment of {SIGNATURE_FILE} (key id {sig.key}) is "
            f"{sig.trusted_comment[:120]!r}, not {want!r}: the signature was made for something "
            f"else; sign this bundle ('prefix-bundles sign', or minisign -S -t '{want}')",
            SIGNATURE_FILE,
        )


@dataclass(frozen=True)
class SignatureInfo:
    """What inspect shows: who signed the bundle and the trusted comment (not a verdict)."""

    key_id: str | None
    trusted_comment: str | None
    problem: str | None  # why it cannot be read, when it cannot


def describe(bundle: Path) -> SignatureInfo | None:
    """The bundle's signature as written (None when unsigned); verification is the validator's."""
    if not os.path.lexists(Path(bundle) / SIGNATURE_FILE):
        return None
    try:
        sig = read_signature(bundle)
    except BundleError as exc:
        return SignatureInfo(None, None, exc.reason)
    return SignatureInfo(sig.key, sig.trusted_comment, None)


__all__ = [
    "SignatureInfo",
    "check_binding",
    "check_signature",
    "describe",
    "read_signature",
    "trusted_comment",
]
