"""Reading files a person or another program may have replaced with something else.

A FIFO, a device or a socket is refused without blocking on it (opened non-blocking, then checked),
and a size limit keeps a hostile file from filling memory.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


class FileProblem(ValueError):
    """The path is not a readable regular file within the size limit; the message says which."""


def kind_of(mode: int) -> str:
    """'a directory', 'a FIFO', 'a regular file', ... for a st_mode (what a path is, for a
    message saying it is not what was expected)."""
    kinds = {
        stat.S_ISREG: "a regular file",
        stat.S_ISDIR: "a directory",
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISSOCK: "a socket",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISLNK: "a symlink",
    }
    return next((name for test, name in kinds.items() if test(mode)), "of an unknown file type")


def open_regular(path: Path, *, follow: bool = True) -> int:
    """A read descriptor of a regular file, opened without blocking (a FIFO, a device) and, with
    follow=False, without following a link at its last part; FileProblem otherwise."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    flags |= 0 if follow else getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise FileProblem("does not exist") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise FileProblem("is a symlink (links are not followed)") from None
        raise FileProblem(f"cannot be opened ({exc.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        os.close(fd)
        raise FileProblem(f"cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise FileProblem(f"is {kind_of(mode)}, not a regular file")
    return fd


def read_regular(path: Path, max_bytes: int, *, follow: bool = True) -> bytes:
    """The bytes of a regular file of at most max_bytes; FileProblem otherwise (never blocks;
    follow=False: a link is refused, as the validator refuses links in a bundle)."""
    fd = open_regular(path, follow=follow)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise FileProblem(f"is {size:,} bytes, over the {max_bytes:,}-byte limit")
        chunks, total = [], 0
        while chunk := os.read(fd, 1 << 20):
            total += len(chunk)
            if total > max_bytes:
                raise FileProblem(f"grew past the {max_bytes:,}-byte limit while being read")
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise FileProblem(f"cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)


def read_text(path: Path, max_bytes: int) -> str:
    """read_regular, decoded as UTF-8 (FileProblem when it is not)."""
    try:
        return read_regular(path, max_bytes).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileProblem(f"is not UTF-8 text (byte {exc.start})") from None
