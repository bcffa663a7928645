"""minisign-format secret keys: generate, write, read (scrypt-encrypted or not), and sign bytes.

Secret key file: `untrusted comment: ...` + base64("Ed" + kdf[2] + "B2" + salt[32] + opslimit[8]
+ memlimit[8] + (key id[8] + secret key[64] + checksum[32]) XOR scrypt stream), kdf "Sc" (scrypt,
parameters derived from opslimit/memlimit as libsodium does) or "\\0\\0" (unencrypted: minisign -W).
The checksum is BLAKE2b-256 of "Ed" + key id + secret key. Only builders and the CLI import this.
"""

from __future__ import annotations

import base64
import hashlib
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from pipeline.format.signature import (
    ALG,
    ALG_HASHED,
    COMMENT_PREFIX,
    PublicKey,
    Signature,
    b64decode_exact,
    signed_bytes,
)

KDF_SCRYPT = b"Sc"
KDF_NONE = b"\0\0"
CHK_ALG = b"B2"
# libsodium's crypto_pwhash_scryptsalsa208sha256_{OPS,MEM}LIMIT_SENSITIVE: what minisign -G uses
OPSLIMIT_SENSITIVE = 33554432
MEMLIMIT_SENSITIVE = 1073741824
SECRET_KEY_BYTES = 158
SECRET_COMMENT = "minisign encrypted secret key"  # minisign writes this even for -W keys


@dataclass(frozen=True)
class SecretKey:
    """An Ed25519 key pair with its minisign key id."""

    key_id: bytes  # 8 bytes
    seed: bytes  # 32 bytes: the first half of libsodium's 64-byte secret key
    public: bytes  # 32 bytes: the second half

    def public_key(self) -> PublicKey:
        return PublicKey(self.key_id, self.public)

    def sign(self, message: bytes, trusted_comment: str) -> Signature:
        """A prehashed ("ED") minisign signature of `message` with `trusted_comment`."""
        if "\n" in trusted_comment or "\r" in trusted_comment:
            raise ValueError("a trusted comment is one line")
        signer = Ed25519PrivateKey.from_private_bytes(self.seed)
        sig = signer.sign(signed_bytes(ALG_HASHED, message))
        glob = signer.sign(sig + trusted_comment.encode())
        return Signature(ALG_HASHED, self.key_id, sig, trusted_comment, glob)


def generate() -> SecretKey:
    """A new random key pair and key id."""
    private = Ed25519PrivateKey.generate()
    seed = private.private_bytes_raw()
    public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return SecretKey(os.urandom(8), seed, public)


def scrypt_params(opslimit: int, memlimit: int) -> tuple[int, int, int]:
    """(N, r, p) for libsodium's crypto_pwhash_scryptsalsa208sha256 limits (its pickparams)."""
    opslimit = max(opslimit, 32768)
    r = 8
    if opslimit < memlimit // 32:
        p, max_n = 1, opslimit // (r * 4)
    else:
        max_n = memlimit // (r * 128)
    n_log2 = 1
    while n_log2 < 63 and (1 << n_log2) <= max_n // 2:
        n_log2 += 1
    if not opslimit < memlimit // 32:
        p = min((opslimit // 4) // (1 << n_log2), 0x3FFFFFFF) // r
    return 1 << n_log2, r, max(p, 1)


def _stream(password: str, salt: bytes, opslimit: int, memlimit: int) -> bytes:
    n, r, p = scrypt_params(opslimit, memlimit)
    return hashlib.scrypt(
        password.encode(),
        salt=salt,
        n=n,
        r=r,
        p=p,
        dklen=104,
        maxmem=128 * r * (n + p + 2) + (1 << 24),
    )


def _checksum(key_id: bytes, secret: bytes) -> bytes:
    return hashlib.blake2b(ALG + key_id + secret, digest_size=32).digest()


def secret_key_text(
    key: SecretKey,
    password: str | None,
    opslimit: int = OPSLIMIT_SENSITIVE,
    memlimit: int = MEMLIMIT_SENSITIVE,
) -> str:
    """The secret key file: encrypted with `password`, or unencrypted when it is None (-W)."""
    secret = key.seed + key.public
    body = key.key_id + secret + _checksum(key.key_id, secret)
    if password is None:
        head = ALG + KDF_NONE + CHK_ALG + bytes(48)
    else:
        salt = os.urandom(32)
        stream = _stream(password, salt, opslimit, memlimit)
        body = bytes(a ^ b for a, b in zip(body, stream, strict=True))
        head = ALG + KDF_SCRYPT + CHK_ALG + salt + struct.pack("<QQ", opslimit, memlimit)
    return f"{COMMENT_PREFIX}{SECRET_COMMENT}\n{base64.b64encode(head + body).decode()}\n"


def is_encrypted(text: str) -> bool:
    """Whether a secret key file needs a password (its kdf is scrypt)."""
    return _decode(text)[2:4] == KDF_SCRYPT


def parse_secret_key(text: str, password: Callable[[], str] | None = None) -> SecretKey:
    """A secret key file's text; `password` is asked only for an encrypted key. ValueError if bad."""
    raw = _decode(text)
    if raw[:2] != ALG or raw[4:6] != CHK_ALG:
        raise ValueError(f"algorithms {raw[:2]!r}/{raw[4:6]!r} are not Ed25519 with BLAKE2b")
    body = raw[54:]
    if raw[2:4] == KDF_SCRYPT:
        if password is None:
            raise ValueError("it is encrypted and no password was given")
        opslimit, memlimit = struct.unpack("<QQ", raw[38:54])
        if memlimit > 4 * MEMLIMIT_SENSITIVE or opslimit > 4 * OPSLIMIT_SENSITIVE:
            raise ValueError(f"its scrypt limits ({opslimit}, {memlimit}) are unreasonably high")
        stream = _stream(password(), raw[6:38], opslimit, memlimit)
        body = bytes(a ^ b for a, b in zip(body, stream, strict=True))
    elif raw[2:4] != KDF_NONE:
        raise ValueError(f"key derivation {raw[2:4]!r} is neither scrypt ('Sc') nor none")
    key_id, secret, chk = body[:8], body[8:72], body[72:]
    encrypted = raw[2:4] == KDF_SCRYPT
    if (encrypted or chk != bytes(32)) and chk != _checksum(key_id, secret):
        raise ValueError("wrong password" if encrypted else "its checksum does not match")
    key = SecretKey(key_id, secret[:32], secret[32:])
    derived = Ed25519PrivateKey.from_private_bytes(key.seed).public_key()
    if derived.public_bytes(Encoding.Raw, PublicFormat.Raw) != key.public:
        raise ValueError("its public half does not belong to its secret half")
    return key


def _decode(text: str) -> bytes:
    lines = text.splitlines()
    if len(lines) != 2 or not lines[0].startswith(COMMENT_PREFIX):
        raise ValueError(f"expected an '{COMMENT_PREFIX}...' line and a base64 line")
    return b64decode_exact(lines[1], SECRET_KEY_BYTES, "secret key")


__all__ = [
    "SecretKey",
    "generate",
    "is_encrypted",
    "parse_secret_key",
    "scrypt_params",
    "secret_key_text",
]
