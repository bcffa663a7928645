"""The one safe tree: what every writer of a published or private folder does, done once.

Walks: every path is walked from a root one component at a time, each folder opened with O_NOFOLLOW
(a folder that is, or is swapped for, a link is refused, not followed), and each create, rename,
exchange or delete runs on a name relative to the last folder's descriptor. The root itself may be
a link (a deploy's choice); nothing below it may be. The files in such a tree are written, locked
and checked by its companion, pipeline.format.safe_files. Used by the builder's bundles tree,
pull's resume folder and runtime snapshots.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeline.format.errors import PipelineError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)


def inside(root: Path, path: Path) -> tuple[str, ...]:
    """path's components below root; PipelineError when it is not strictly below root."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
    parts = tuple(Path(rel).parts)
    if not parts or parts[0] in (os.pardir, os.curdir) or os.pardir in parts:
        raise PipelineError(
            f"{path} is not inside the bundles folder {root}; nothing outside it is changed"
        )
    return parts


@contextmanager
def folder_fd(root: Path, parts: tuple[str, ...], *, create: bool = False) -> Iterator[int]:
    """A descriptor of root/parts, walked without following links (created when asked)."""
    if create:
        try:
            os.makedirs(root, exist_ok=True)  # the root is the caller's choice, links and all
        except FileExistsError:  # a file where the root should be: say so as mkdir(child) would
            code, child = errno.ENOTDIR, os.path.join(root, *parts[:1])
            raise NotADirectoryError(code, os.strerror(code), child) from None
    fd = os.open(root, _DIR_FLAGS)
    try:
        for depth, part in enumerate(parts):
            if create:
                try:
                    os.mkdir(part, 0o777, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                child = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise _not_a_folder(root, parts[: depth + 1], fd) from None
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def _not_a_folder(root: Path, parts: tuple[str, ...], parent_fd: int) -> PipelineError:
    path = Path(root, *parts)
    try:
        mode = os.stat(parts[-1], dir_fd=parent_fd, follow_symlinks=False).st_mode
    except OSError:
        mode = 0
    if stat.S_ISLNK(mode):
        return PipelineError(
            f"{path} is a symlink ({os.readlink(parts[-1], dir_fd=parent_fd)}); nothing under "
            f"the bundles folder {root} is created, renamed or deleted through a link: replace "
            "it with a real folder"
        )
    return PipelineError(f"{path} is not a folder; move it away from the bundles folder {root}")


def make_folders(root: Path, path: Path) -> None:
    """Create path (and its parents) under root, refusing any link on the way."""
    with folder_fd(root, inside(root, path), create=True):
        pass


def is_link_or_missing(root: Path, path: Path) -> bool | None:
    """True for a link, False for anything else, None when nothing is there (links not followed)."""
    parts = inside(root, path)
    with folder_fd(root, parts[:-1]) as fd:
        try:
            return stat.S_ISLNK(os.stat(parts[-1], dir_fd=fd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return None


def remove_tree(root: Path, path: Path) -> None:
    """Delete the folder at path; a link there, or on the way to it, is refused, never followed."""
    parts = inside(root, path)
    with folder_fd(root, parts[:-1]) as fd:
        mode = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False).st_mode
        if not stat.S_ISDIR(mode):
            raise _not_a_folder(root, parts, fd)
        remove_at(fd, parts[-1])


def remove_at(parent_fd: int, name: str) -> None:
    """Delete the folder `name` in the folder open as parent_fd, descending through descriptors
    only: a link inside is unlinked, never followed (shutil.rmtree's dir_fd needs Python 3.11)."""
    walk_at(parent_fd, name, lambda fd, entry: os.unlink(entry.name, dir_fd=fd), os.rmdir)


def remove_entry_at(parent_fd: int, name: str) -> None:
    """Delete whatever `name` is in the folder open as parent_fd: a folder with all in it, or
    anything else (a link is unlinked, never followed)."""
    if stat.S_ISDIR(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode):
        remove_at(parent_fd, name)
    else:
        os.unlink(name, dir_fd=parent_fd)


def tree_bytes(root: Path, path: Path) -> int:
    """Bytes of the regular files in the folder at path under root (no link followed)."""
    parts = inside(root, path)
    with folder_fd(root, parts[:-1]) as fd:
        return tree_bytes_at(fd, parts[-1])


def tree_bytes_at(parent_fd: int, name: str) -> int:
    """Bytes of the regular files under the folder `name` (links not followed)."""
    sizes: list[int] = []

    def add(fd: int, entry: os.DirEntry) -> None:
        if entry.is_file(follow_symlinks=False):
            sizes.append(entry.stat(follow_symlinks=False).st_size)

    walk_at(parent_fd, name, add, lambda name, dir_fd: None)
    return sum(sizes)


def walk_at(
    parent_fd: int,
    name: str,
    visit: Callable[[int, os.DirEntry], None],
    leave: Callable[..., None],
) -> None:
    """`visit(fd, entry)` for every entry under the folder `name` that is not a folder (its
    folder open as fd), then `leave(folder name, dir_fd=its parent's fd)` for each folder,
    deepest first. Through descriptors only, never a link followed, and without recursion: a
    tree of any depth (one open descriptor per level: past the process's limit, an OSError)."""
    stack: list[tuple[int, str, int, list[str]]] = []  # (parent fd, name, fd, folders left)

    def enter(parent: int, folder: str) -> None:
        fd = os.open(folder, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
        stack.append((parent, folder, fd, []))
        with os.scandir(fd) as found:
            for entry in list(found):
                if entry.is_dir(follow_symlinks=False):
                    stack[-1][3].append(entry.name)
                else:
                    visit(fd, entry)

    try:
        enter(parent_fd, name)
        while stack:
            parent, folder, fd, left = stack[-1]
            if left:
                enter(fd, left.pop())
                continue
            stack.pop()
            os.close(fd)
            leave(folder, dir_fd=parent)
    finally:
        for _, _, fd, _ in stack:
            os.close(fd)


def remove_empty(root: Path, path: Path) -> bool:
    """Remove the folder at path when it is empty; whether it was."""
    parts = inside(root, path)
    try:
        with folder_fd(root, parts[:-1]) as fd:
            os.rmdir(parts[-1], dir_fd=fd)
    except (OSError, PipelineError):
        return False
    return True


def rename(root: Path, src: Path, dst: Path) -> None:
    """Rename src to dst, both under root (OSError as rename(2) gives it)."""
    s, d = inside(root, src), inside(root, dst)
    with folder_fd(root, s[:-1]) as sfd, folder_fd(root, d[:-1]) as dfd:
        os.rename(s[-1], d[-1], src_dir_fd=sfd, dst_dir_fd=dfd)


def exchange(root: Path, a: Path, b: Path) -> bool:
    """Atomically swap two paths under root; False where the platform or filesystem cannot."""
    pa, pb = inside(root, a), inside(root, b)
    libc = ctypes.CDLL(None, use_errno=True)
    with folder_fd(root, pa[:-1]) as afd, folder_fd(root, pb[:-1]) as bfd:
        na, nb = os.fsencode(pa[-1]), os.fsencode(pb[-1])
        if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
            return libc.renameat2(afd, na, bfd, nb, 2) == 0  # RENAME_EXCHANGE
        if sys.platform == "darwin" and hasattr(libc, "renameatx_np"):
            return libc.renameatx_np(afd, na, bfd, nb, 0x2) == 0  # RENAME_SWAP
    return False


def entries(root: Path, path: Path) -> list[str]:
    """Names in the folder at path (a link there or on the way is refused)."""
    with folder_fd(root, inside(root, path)) as fd:
        return sorted(os.listdir(fd))


def open_folder_at(parent_fd: int | None, name: str | Path) -> int:
    """A descriptor of the folder `name` (in the folder open as parent_fd); OSError for a link
    (ELOOP or ENOTDIR: never followed) or anything but a folder."""
    return os.open(name, _DIR_FLAGS | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=parent_fd)


def is_empty_at(parent_fd: int, name: str) -> bool:
    """Whether `name` is a real folder (not a link) holding nothing."""
    try:
        fd = open_folder_at(parent_fd, name)
    except OSError:
        return False
    try:
        with os.scandir(fd) as found:
            return not any(found)
    except OSError:
        return False
    finally:
        os.close(fd)
