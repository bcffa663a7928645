"""minisign-format Ed25519 signatures: public key files, signature files, verification over bytes.

The formats are minisign's (https://jedisct1.github.io/minisign/), so keys and signatures work
with the `minisign` tool both ways:
  public key     `untrusted comment: ...` + base64("Ed" + key id[8] + public key[32])
  signature      `untrusted comment: ...` + base64(alg[2] + key id[8] + Ed25519 signature[64])
                 + `trusted comment: TEXT` + base64(Ed25519 signature over signature[64] + TEXT)
alg "ED" signs BLAKE2b-512(message) (minisign's default), the legacy "Ed" the message itself;
both verify. A key id prints as minisign prints it: the 8 bytes as a little-endian hex number.
Secret keys and signing are in pipeline.format.secret_key (the runtime only verifies).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.format.errors import PipelineError
from pipeline.format.regular_files import FileProblem, read_regular

ALG = b"Ed"  # a public or secret key's algorithm; also a legacy (not prehashed) signature
ALG_HASHED = b"ED"  # a signature over BLAKE2b-512 of the message: what we and minisign write
COMMENT_PREFIX = "untrusted comment: "
TRUSTED_PREFIX = "trusted comment: "
MAX_COMMENT_BYTES = 1024  # minisign's COMMENTMAXBYTES (the untrusted comment line)
MAX_TRUSTED_BYTES = 8192  # minisign's TRUSTEDCOMMENTMAXBYTES
MAX_SIGNATURE_FILE_BYTES = 16384
MAX_KEY_FILE_BYTES = 4096


class SignatureError(PipelineError):
    """A key or signature file is unreadable, malformed, or does not verify."""


def key_id_text(key_id: bytes) -> str:
    """The key id as minisign shows it: the 8 bytes read as a little-endian number, 16 hex digits."""
    return f"{int.from_bytes(key_id, 'little'):016X}"


def b64decode_exact(text: str, size: int, what: str) -> bytes:
    """Strict base64 of exactly `size` bytes; ValueError naming `what` otherwise."""
    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"the {what} line is not base64") from None
    if len(raw) != size:
        raise ValueError(f"the {what} is {len(raw)} bytes, not {size}")
    return raw


@dataclass(frozen=True)
class PublicKey:
    """An Ed25519 public key with its minisign key id."""

    key_id: bytes  # 8 bytes, as stored
    key: bytes  # 32 bytes

    @property
    def id(self) -> str:
        return key_id_text(self.key_id)

    def file_text(self) -> str:
        """The public key file, as `minisign -G` writes it."""
        body = base64.b64encode(ALG + self.key_id + self.key).decode()
        return f"{COMMENT_PREFIX}minisign public key {self.id}\n{body}\n"


def parse_public_key(text: str) -> PublicKey:
    """A public key file's text (comment line + base64), or the bare base64 line (`minisign -P`)."""
    lines = text.splitlines()
    if len(lines) == 1:
        line = lines[0]
    elif len(lines) == 2 and lines[0].startswith(COMMENT_PREFIX):
        line = lines[1]
    else:
        raise ValueError(f"expected an '{COMMENT_PREFIX}...' line and a base64 line")
    raw = b64decode_exact(line, 42, "public key")
    if raw[:2] != ALG:
        raise ValueError(f"algorithm {raw[:2]!r} is not Ed25519 ('Ed')")
    # loading the key proves it usable and imports the library once, at startup (~35 ms measured:
    # docs/signing.md), not during a mount
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    Ed25519PublicKey.from_public_bytes(raw[10:])
    return PublicKey(raw[2:10], raw[10:])


def read_public_key(path: Path) -> PublicKey:
    """A public key file (minisign's or ours); SignatureError naming the file otherwise."""
    try:
        text = read_regular(Path(path), MAX_KEY_FILE_BYTES).decode("ascii")
        return parse_public_key(text)
    except FileProblem as exc:
        raise SignatureError(f"public key {path} {exc}; pass a minisign public key file") from None
    except (UnicodeDecodeError, ValueError) as exc:
        detail = "it is not ASCII text" if isinstance(exc, UnicodeDecodeError) else str(exc)
        raise SignatureError(
            f"public key {path} is not a minisign public key ({detail}); pass the .pub file "
            "that 'prefix-bundles keygen' or 'minisign -G' wrote"
        ) from None


def read_trusted_keys(paths: Sequence[Path]) -> tuple[PublicKey, ...]:
    """The public keys of --trusted-key files, each once, in the order given."""
    keys: dict[bytes, PublicKey] = {}
    for path in paths:
        key = read_public_key(path)
        keys.setdefault(key.key_id + key.key, key)
    return tuple(keys.values())


@dataclass(frozen=True)
class Signature:
    """A parsed minisign signature file."""

    algorithm: bytes  # ALG_HASHED or the legacy ALG
    key_id: bytes
    signature: bytes  # over the message (or its BLAKE2b-512)
    trusted_comment: str
    global_signature: bytes  # over signature + trusted comment
    untrusted_comment: str = "signature from minisign secret key"

    @property
    def key(self) -> str:
        return key_id_text(self.key_id)

    def file_bytes(self) -> bytes:
        """The signature file, as `minisign -S` writes it."""
        sig = base64.b64encode(self.algorithm + self.key_id + self.signature).decode()
        glob = base64.b64encode(self.global_signature).decode()
        return (
            f"{COMMENT_PREFIX}{self.untrusted_comment}\n{sig}\n"
            f"{TRUSTED_PREFIX}{self.trusted_comment}\n{glob}\n"
        ).encode()


def parse_signature(data: bytes) -> Signature:
    """A signature file's bytes: four lines as minisign writes them; ValueError says what is wrong."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("it is not UTF-8 text") from None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    if len(lines) != 4:
        count = f"{len(lines)} line{'' if len(lines) == 1 else 's'}"
        raise ValueError(f"it has {count}, a signature file has 4")
    lines = [line.removesuffix("\r") for line in lines]
    comment, sig_line, trusted, global_line = lines
    if not comment.startswith(COMMENT_PREFIX) or len(comment.encode()) >= MAX_COMMENT_BYTES:
        raise ValueError(f"line 1 is not an '{COMMENT_PREFIX}...' line")
    if not trusted.startswith(TRUSTED_PREFIX) or len(trusted.encode()) >= MAX_TRUSTED_BYTES:
        raise ValueError(f"line 3 is not a '{TRUSTED_PREFIX}...' line")
    trusted_text = trusted[len(TRUSTED_PREFIX) :]
    if any((ord(c) < 0x20 and c != "\t") or 0x7F <= ord(c) <= 0x9F for c in trusted_text):
        raise ValueError("the trusted comment holds unprintable characters")
    raw = b64decode_exact(sig_line, 74, "signature")
    if raw[:2] not in (ALG, ALG_HASHED):
        raise ValueError(f"signature algorithm {raw[:2]!r} is neither 'ED' nor 'Ed'")
    glob = b64decode_exact(global_line, 64, "trusted comment signature")
    return Signature(
        raw[:2], raw[2:10], raw[10:], trusted_text, glob, comment[len(COMMENT_PREFIX) :]
    )


def signed_bytes(algorithm: bytes, message: bytes) -> bytes:
    """What the Ed25519 signature covers: BLAKE2b-512 of the message ("ED") or the message ("Ed")."""
    return hashlib.blake2b(message, digest_size=64).digest() if algorithm == ALG_HASHED else message


def check(signature: Signature, message: bytes, key: PublicKey) -> str | None:
    """None when `signature` by `key` verifies over `message` and its trusted comment, else why not."""
    # imported lazily: only a process that checks signatures pays for it (parse_public_key did)
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if signature.key_id != key.key_id:
        return f"it is by key id {signature.key}, not {key.id}"
    verifier = Ed25519PublicKey.from_public_bytes(key.key)
    try:
        verifier.verify(signature.signature, signed_bytes(signature.algorithm, message))
    except InvalidSignature:
        return "the signature does not match the file (the file or the signature was altered)"
    try:
        verifier.verify(
            signature.global_signature, signature.signature + signature.trusted_comment.encode()
        )
    except InvalidSignature:
        return "the trusted comment's signature does not verify (the comment was altered)"
    return None


__all__ = [
    "PublicKey",
    "Signature",
    "SignatureError",
    "check",
    "key_id_text",
    "parse_public_key",
    "parse_signature",
    "read_public_key",
    "read_trusted_keys",
]
