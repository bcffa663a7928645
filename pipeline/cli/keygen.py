"""`keygen`: a minisign-format key pair for signing bundles (the secret key encrypted by default)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from pipeline.cli.common import add_json_option, emit_json
from pipeline.format.errors import PipelineError


def add_parser(sub: argparse._SubParsersAction, parents: list) -> None:
    k = sub.add_parser(
        "keygen",
        parents=parents,
        help="make a signing key pair (minisign format; works with the minisign tool)",
    )
    k.add_argument(
        "--secret-key", type=Path, default=Path("prefix-bundles.key"), metavar="FILE",
        help="where the secret key goes (default: prefix-bundles.key; mode 0600)",
    )  # fmt: skip
    k.add_argument(
        "--public-key", type=Path, metavar="FILE",
        help="where the public key goes (default: the secret key's name with .pub)",
    )  # fmt: skip
    k.add_argument(
        "--unencrypted", "-W", action="store_true",
        help="store the secret key without a password (as minisign -W; for CI secrets)",
    )  # fmt: skip
    k.add_argument("--force", "-f", action="store_true", help="overwrite existing key files")
    add_json_option(k, "keygen")
    k.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.format.secret_key import generate, secret_key_text

    secret_path = Path(args.secret_key)
    public_path = Path(args.public_key or secret_path.with_suffix(".pub"))
    if secret_path == public_path:
        raise PipelineError(f"--secret-key and --public-key are both {secret_path}; pass two names")
    for path in (secret_path, public_path):
        if os.path.lexists(path) and not args.force:
            raise PipelineError(f"{path} exists; pass --force to replace the key pair")
    key = generate()
    secret_text = secret_key_text(key, None if args.unencrypted else _new_password())
    _write(secret_path, secret_text, 0o600, args.force)
    _write(public_path, key.public_key().file_text(), 0o644, args.force)
    if args.json:
        from pipeline.cli.reports import KeygenReport

        emit_json(
            KeygenReport(
                key_id=key.public_key().id,
                secret_key=str(secret_path),
                public_key=str(public_path),
                encrypted=not args.unencrypted,
            )
        )
        return 0
    print(f"key id {key.public_key().id}")
    print(f"secret key: {secret_path} (keep it secret{'' if args.unencrypted else '; encrypted'})")
    print(f"public key: {public_path} (deploy it; pass it with --trusted-key)")
    return 0


def _new_password() -> str:
    from pipeline.cli.keys import PASSWORD_ENV, password

    first = password("Password for the new secret key: ")
    if PASSWORD_ENV not in os.environ and first != password("Password (again): "):
        raise PipelineError("the passwords differ; nothing was written")
    if not first:
        raise PipelineError("an empty password; pass --unencrypted for a key without one")
    return first


def _write(path: Path, text: str, mode: int, force: bool) -> None:
    """Write a key file with its mode from the start; replace only with --force."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        if force:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # fails if the file appeared meanwhile: never overwrite silently
            os.unlink(tmp)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise PipelineError(f"cannot write {path}: {exc.strerror}") from None
