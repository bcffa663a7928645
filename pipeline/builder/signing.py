"""Signing a bundle: manifest.json.minisig added atomically; no other file is rewritten.

The signature covers manifest.json's exact bytes (which pin the cache file, tokens and
fingerprints); its trusted comment binds prefix, version and model folder
(pipeline.format.bundle_signature.trusted_comment).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from pipeline.format.bundle_folder import (
    MANIFEST_FILE,
    SIGNATURE_FILE,
    parse_manifest,
    read_manifest,
    read_manifest_bytes,
    read_sums,
)
from pipeline.format.bundle_signature import trusted_comment
from pipeline.format.errors import BuildError
from pipeline.format.secret_key import SecretKey
from pipeline.format.signature import Signature
from pipeline.format.validate import recorded_identity, validate


def sign_manifest(bundle: Path, key: SecretKey) -> Signature:
    """Sign the manifest.json that SHA256SUMS lists and put the signature beside it atomically.

    The caller has validated the bundle (sign_bundle does; the builder signs what it just checked).
    """
    bundle = Path(bundle)
    data = read_manifest_bytes(bundle, read_sums(bundle)[MANIFEST_FILE])
    signature = key.sign(data, trusted_comment(parse_manifest(bundle, data)))
    write_signature(bundle, signature)
    return signature


def sign_bundle(bundle: Path, key: SecretKey) -> Signature:
    """Validate a bundle's integrity (every byte hashed), then sign it; BundleError if refused."""
    bundle = Path(bundle)
    validate(bundle, recorded_identity(read_manifest(bundle, None)))
    return sign_manifest(bundle, key)


def write_signature(bundle: Path, signature: Signature) -> None:
    """Write manifest.json.minisig with one rename, from a temporary file beside the bundle folder.

    The temporary file is outside the folder, so a server mounting meanwhile never sees a file
    that is not part of a bundle; an existing signature (another key, rotation) is replaced.
    """
    tmp = bundle.parent / f".{bundle.name}.{SIGNATURE_FILE}.{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(tmp, "xb") as fh:
            fh.write(signature.file_bytes())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, bundle / SIGNATURE_FILE)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise BuildError(
            f"cannot write {bundle / SIGNATURE_FILE}: {exc.strerror}; make the bundle writable"
        ) from None


__all__ = ["sign_bundle", "sign_manifest", "write_signature"]
