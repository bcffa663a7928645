"""Files in the safe tree, written and checked once for every writer: owner-only checks and
modes, new files never written through a link, one file staged beside its place and then put
there whole (one link or one rename), flock locks that never block on a FIFO, fsync.

Used by the bundle writer, snapshots and their host key, the hash memo, keygen and signing;
folders are walked, made and removed by pipeline.format.safe_tree.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

from pipeline.format.regular_files import FileProblem

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
PRIVATE_FOLDER, PRIVATE_FILE = 0o700, 0o600
PUBLIC_FILE = 0o666  # less the umask, as for any file: what is deployed must be readable


def read_at(dir_fd: int | None, name: str | Path, limit: int) -> bytes | None:
    """Up to `limit` bytes of the regular file `name`; None for anything else or nothing (a
    link is never followed, a FIFO never blocks)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        return os.read(fd, limit) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    finally:
        os.close(fd)


def not_private(st: os.stat_result, want_dir: bool, forbidden: int = 0o077) -> str | None:
    """Why a folder (want_dir) or file is not private: "kind" (not a folder, or not a regular
    file), "owner" (another user's) or "mode" (a `forbidden` mode bit set); None when it is."""
    kind_ok = stat.S_ISDIR(st.st_mode) if want_dir else stat.S_ISREG(st.st_mode)
    if not kind_ok:
        return "kind"
    if st.st_uid != os.geteuid():
        return "owner"
    return "mode" if st.st_mode & forbidden else None


def write_new(
    path: str | Path,
    data: bytes,
    mode: int = PRIVATE_FILE,
    dir_fd: int | None = None,
    sync: bool = True,
) -> None:
    """A new file holding `data`, with `mode` (less the umask) from its creation, synced unless
    told; never one already there, never through a link (FileExistsError, OSError)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
    fd = os.open(path, flags, mode, dir_fd=dir_fd)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
        out.flush()
        if sync:
            os.fsync(out.fileno())


def stage_beside(path: Path, data: bytes, mode: int = PRIVATE_FILE, sync: bool = True) -> Path:
    """A new temporary file beside `path` holding `data` (`write_new`), under a name no earlier
    process can have left behind (a container reuses its pids)."""
    while True:
        tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
        try:
            write_new(tmp, data, mode, sync=sync)
            return tmp
        except FileExistsError:
            continue
        except BaseException:  # a full disk: no half-written file is left behind
            tmp.unlink(missing_ok=True)
            raise


def put_in_place(tmp: Path, path: Path, replace: bool) -> None:
    """Publish a staged file whole: with `replace`, one rename over what is there; without, one
    link that fails (FileExistsError) where a file appeared meanwhile: never overwritten."""
    if replace:
        os.replace(tmp, path)
    else:
        os.link(tmp, path, follow_symlinks=False)


def publish_file(
    path: Path,
    data: bytes,
    mode: int = PRIVATE_FILE,
    *,
    replace: bool = True,
    stage_as: Path | None = None,
    sync: bool = True,
) -> None:
    """`data` at `path` whole or not at all: staged beside `stage_as` (default: path itself; a
    file staged outside a published folder is never seen in it), then put in place
    (`put_in_place`); the staged file never stays."""
    tmp = stage_beside(stage_as or path, data, mode, sync)
    try:
        put_in_place(tmp, path, replace)
    finally:
        tmp.unlink(missing_ok=True)


class LockHeld(Exception):
    """Another open file holds the lock."""


def lock_at(dir_fd: int | None, name: str | Path, create: bool) -> int | None:
    """An exclusive flock on the regular file `name` (made owner-only when `create`), held until
    the returned fd is closed; None when it is missing and not made. OSError when it cannot be
    opened (a link is refused), FileProblem when it is not a regular file, LockHeld when taken."""
    # never blocks on a FIFO someone put there; only a regular file is a lock
    flags = (os.O_RDWR | os.O_CREAT if create else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(name, flags | _CLOEXEC, PRIVATE_FILE, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FileProblem("is not a regular file")
        take_lock(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def take_lock(fd: int) -> None:
    """flock(LOCK_EX) on an open file without waiting (a no-op for the open file holding it);
    LockHeld when another holds it."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise
        raise LockHeld from None


def sync_path(path: str | Path, strict: bool = False) -> None:
    """fsync a file or folder by path (a folder: its entries survive a power loss); `strict`
    raises what fails, else a folder a filesystem cannot sync is left as it is."""
    try:
        fd = os.open(path, os.O_RDONLY | _CLOEXEC)
    except OSError:
        if strict:
            raise
        return
    try:
        os.fsync(fd)
    except OSError:
        if strict:
            raise
    finally:
        os.close(fd)
