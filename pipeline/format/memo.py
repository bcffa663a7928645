"""sha256 memo: a file hashed in full once is not re-hashed while its stat says it is unchanged.

What it trusts: that a file whose path, size, mtime_ns, ctime_ns, inode and device are all as when it
was hashed still holds the same bytes. ctime cannot be set back by a user (only by changing the
clock as root), so an in-place edit with a restored mtime is re-hashed. The memo lives in
~/.cache/mlx-prefix-bundles (PREFIX_BUNDLES_CACHE_DIR or XDG_CACHE_HOME move it), 0700 folder,
0600 file; a memo file or folder that is not owned by this user or is open to others is ignored.
Used for model weights (fingerprints) and by `mount` on a restart; `verify` always hashes in full.
The validator takes a cache file's key from the one open file it then reads (open_key), never
from a second lookup of the path, and re-checks it after the read.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from pipeline.format.safe_files import PRIVATE_FILE, PRIVATE_FOLDER, not_private, publish_file

_lock = threading.Lock()
_HEX64 = re.compile(r"^[0-9a-f]{64}\Z")
MAX_MEMO_BYTES = 16 << 20


def memo_path() -> Path:
    """Where the memo file lives."""
    base = os.environ.get("PREFIX_BUNDLES_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mlx-prefix-bundles"
    )
    return Path(base) / "sha256-memo.json"


def stat_key(path: Path) -> str:
    """Identity of a file's current contents as the filesystem reports it."""
    real = os.path.realpath(path)
    return open_key(real, os.stat(real))


def open_key(real: str, st: os.stat_result) -> str:
    """stat_key of a file already open, from its fstat: the numbers are those of the bytes that
    will be read (the path is only the label that lets `store` forget its older states)."""
    return "|".join([real, *map(str, file_identity(st))])


def file_identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What the memo trusts as a file's contents: size, mtime, ctime, inode, device (any write,
    rename over or copy in changes one of them)."""
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def _private(path: Path, want_dir: bool) -> bool:
    """Owned by this user, of the right kind, and not readable or writable by anyone else (a
    folder reached through a link is judged as the folder it leads to; a file never is one)."""
    try:
        st = os.stat(path) if want_dir else os.lstat(path)
    except OSError:
        return False
    return not_private(st, want_dir) is None


def _private_folder(folder: Path) -> bool:
    """Whether the memo's folder is private, creating it owner-only when missing. A folder that
    exists is never chmod'ed (PREFIX_BUNDLES_CACHE_DIR may name a shared one, such as /tmp):
    open to others, it keeps no memo."""
    try:
        folder.mkdir(mode=PRIVATE_FOLDER, parents=True)
    except FileExistsError:
        pass
    except OSError:
        return False
    return _private(folder, want_dir=True)


def load_table(memo: Path, values: re.Pattern[str] = _HEX64) -> dict[str, str]:
    """A private {key: hex digest} table (empty when missing, unreadable or open to others);
    `values`: the pattern a kept value matches (a hex digest unless told)."""
    return _load(memo, values)


def update_table(
    memo: Path,
    change: Callable[[dict[str, str]], dict[str, str]],
    values: re.Pattern[str] = _HEX64,
) -> None:
    """Read, change and write a private table under its file lock, so that processes updating it
    at once keep each other's entries (best effort: a read-only home or a lock not granted
    within LOCK_WAIT seconds only costs the entry)."""
    with _lock, _file_lock(memo) as held:
        if held:
            _store(memo, change(_load(memo, values)))


LOCK_WAIT = 10.0


@contextlib.contextmanager
def _file_lock(memo: Path) -> Iterator[bool]:
    """flock on `<memo>.lock` in the private folder; yields whether it is held."""
    from filelock import FileLock, Timeout

    if not _private_folder(memo.parent):
        yield False
        return
    lock = FileLock(str(memo) + ".lock", timeout=LOCK_WAIT, mode=PRIVATE_FILE)
    try:
        lock.acquire()
    except (Timeout, OSError):
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


def _load(memo: Path, values: re.Pattern[str] = _HEX64) -> dict[str, str]:
    if not (_private(memo.parent, want_dir=True) and _private(memo, want_dir=False)):
        return {}
    try:
        table = json.loads(memo.read_bytes()[:MAX_MEMO_BYTES])
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(table, dict):
        return {}
    return {k: v for k, v in table.items() if isinstance(v, str) and values.match(v)}


def _store(memo: Path, table: dict[str, str]) -> None:
    try:  # best effort: a read-only home only costs a re-hash next time
        if not _private_folder(memo.parent):
            return
        # in the table's order: the build record evicts its oldest first; a lost memo only
        # costs a re-hash, so it is not synced
        publish_file(memo, json.dumps(table).encode(), sync=False)
    except OSError:
        pass


def table() -> dict[str, str]:
    """Every trusted entry {stat key: sha256} (empty when the memo is missing or not private)."""
    with _lock:
        return _load(memo_path())


def lookup(key: str) -> str | None:
    """The sha256 recorded for a stat key, if any."""
    with _lock:
        return _load(memo_path()).get(key)


def store(key: str, digest: str) -> None:
    """Record a file's sha256 under its stat key (forgetting that file's older states)."""
    real = key.split("|", 1)[0]

    def change(table: dict[str, str]) -> dict[str, str]:
        kept = {
            k: v
            for k, v in table.items()
            if not k.startswith(real + "|") and os.path.exists(k.split("|", 1)[0])
        }
        return {**kept, key: digest}

    update_table(memo_path(), change)
