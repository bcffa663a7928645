"""`keygen`: a minisign-format key pair for signing bundles (the secret key encrypted by default)."""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

from pipeline.cli.common import add_json_option, emit_json, say
from pipeline.format.errors import PipelineError
from pipeline.format.safe_files import put_in_place, stage_beside


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
    check_destinations(secret_path, public_path, args.force)
    key = generate()
    secret_text = secret_key_text(key, None if args.unencrypted else _new_password())
    write_pair(
        [(secret_path, secret_text, 0o600), (public_path, key.public_key().file_text(), 0o644)],
        args.force,
    )
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
    say(f"key id {key.public_key().id}")
    say(f"secret key: {secret_path} (keep it secret{'' if args.unencrypted else '; encrypted'})")
    say(f"public key: {public_path} (deploy it; pass it with --trusted-key)")
    return 0


def _new_password() -> str:
    from pipeline.cli.keys import PASSWORD_ENV, password

    first = password("Password for the new secret key: ", new=True)
    if PASSWORD_ENV not in os.environ and first != password("Password (again): "):
        raise PipelineError("the passwords differ; nothing was written")
    if not first:
        raise PipelineError("an empty password; pass --unencrypted for a key without one")
    return first


def check_destinations(secret: Path, public: Path, force: bool) -> None:
    """Refuse, before a key is made, two names of one file, a missing folder, a folder in the
    way, or (without --force) a key file already there."""
    if os.path.realpath(secret) == os.path.realpath(public) or _same_file(secret, public):
        raise PipelineError(
            f"--secret-key {secret} and --public-key {public} are the same file; pass two names"
        )
    for path in (secret, public):
        if not path.parent.is_dir():
            raise PipelineError(
                f"cannot write {path}: the folder {path.parent} does not exist; create it or "
                "pass another path (nothing was written)"
            )
        if path.is_dir():
            raise PipelineError(f"{path} is a folder; pass a file name (nothing was written)")
        if os.path.lexists(path) and not force:
            raise PipelineError(f"{path} exists; pass --force to replace the key pair")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)  # two hard links of one file
    except OSError:  # either is missing
        return False


def write_pair(files: list[tuple[Path, str, int]], force: bool) -> None:
    """Both key files or neither: each is written in full beside its destination first, then
    put in place; when one cannot be, what was put in place before it is undone."""
    staged: list[tuple[Path, Path]] = []
    placed: list[tuple[Path, Path | None]] = []
    path = files[0][0]
    try:
        for path, text, mode in files:
            staged.append((path, stage_beside(path, text.encode(), mode)))
        for path, tmp in staged:
            placed.append((path, _place(path, tmp, force)))
    except OSError as exc:
        for done, old in reversed(placed):
            _unplace(done, old)
        raise PipelineError(
            f"cannot write {path}: {exc.strerror or exc}; no key file was written or replaced"
        ) from None
    finally:
        for _, tmp in staged:
            tmp.unlink(missing_ok=True)
    for _, old in placed:
        if old is not None:
            old.unlink(missing_ok=True)


def _place(path: Path, tmp: Path, force: bool) -> Path | None:
    """Put `tmp` at `path`; return a link to the file it replaced (None: there was none)."""
    old = None
    if force and os.path.lexists(path):
        old = _beside(path, "old")
        os.link(path, old, follow_symlinks=False)
    # without --force, a file that appeared meanwhile fails it: never overwritten silently
    put_in_place(tmp, path, replace=force)
    return old


def _unplace(path: Path, old: Path | None) -> None:
    """Undo `_place`: the replaced file back, or the new one gone."""
    with contextlib.suppress(OSError):
        if old is None:
            os.unlink(path)
        else:
            os.replace(old, path)


def _beside(path: Path, what: str) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{what}")
