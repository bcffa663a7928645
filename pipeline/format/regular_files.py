"""Reading files a person or another program may have replaced with something else.

A FIFO, a device or a socket is refused without blocking on it (opened non-blocking, then checked),
and a size limit keeps a hostile file from filling memory.
"""

from __future__ import annotations

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


def read_regular(path: Path, max_bytes: int) -> bytes:
    """The bytes of a regular file of at most max_bytes; FileProblem otherwise (never blocks)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise FileProblem("does not exist") from None
    except OSError as exc:
        raise FileProblem(f"cannot be opened ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileProblem(f"is {kind_of(st.st_mode)}, not a regular file")
        if st.st_size > max_bytes:
            raise FileProblem(f"is {st.st_size:,} bytes, over the {max_bytes:,}-byte limit")
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
