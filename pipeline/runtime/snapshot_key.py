"""The host key that signs runtime snapshots (`serve --snapshots`): created on first use, kept
outside the snapshot folder, owner-only.

A snapshot is a hidden prompt: serve mounts one only when its own host key signed it, so a
snapshot someone else wrote into the folder (another host, an edited file with its sums
recomputed) is refused. The key is an unencrypted minisign secret key (`minisign -W` format).
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from pipeline.format.errors import PipelineError
from pipeline.format.safe_files import PRIVATE_FOLDER, not_private, publish_file

KEY_NAME = "snapshot-host.key"
APP_FOLDER = "mlx-prefix-bundles"


def default_key_path() -> Path:
    """$XDG_CONFIG_HOME/mlx-prefix-bundles/snapshot-host.key (default ~/.config/...)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / APP_FOLDER / KEY_NAME


def host_key(path: Path | None = None):  # -> pipeline.format.secret_key.SecretKey
    """The host's snapshot key: read, or created (0600 in a 0700 folder) when there is none."""
    # imported here: cryptography is paid for only by a serve that writes snapshots
    from pipeline.format.secret_key import generate, parse_secret_key, secret_key_text

    path = Path(path or default_key_path())
    _private_folder(path.parent)
    if not os.path.lexists(path):
        _create(path, secret_key_text(generate(), None))
    _check_private(path, "file", 0o077)
    try:
        return parse_secret_key(path.read_text(encoding="ascii"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise PipelineError(
            f"snapshot host key {path} cannot be read ({exc}); delete it (serve makes a new one, "
            "and the snapshots signed by the old one are no longer mounted)"
        ) from None


def _private_folder(folder: Path) -> None:
    """Create the key's folder owner-only, or check that it is."""
    folder.mkdir(mode=PRIVATE_FOLDER, parents=True, exist_ok=True)
    _check_private(folder, "folder", 0o022)


def _check_private(path: Path, what: str, forbidden: int) -> None:
    """The key (and its folder) is a regular file (folder) of this user that others cannot
    change (nor, for the key, read)."""
    st = os.lstat(path)
    if not_private(st, what == "folder", forbidden) is not None:
        mode = "0700" if what == "folder" else "0600"
        raise PipelineError(
            f"snapshot host key {what} {path} must be a {what} of this user with mode {mode} "
            f"(found mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}); "
            f"fix it with 'chmod {mode[1:]} {path}' or remove it"
        )


def _create(path: Path, text: str) -> None:
    """Write the key once, atomically (a concurrent first start keeps the first key)."""
    with contextlib.suppress(FileExistsError):  # another process created it first
        publish_file(path, text.encode("ascii"), replace=False)


__all__ = ["default_key_path", "host_key"]
