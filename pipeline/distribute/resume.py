"""Partly rebuilt cache files of interrupted pulls, kept in <bundles>/.staging/resume/ by artifact
digest for the next pull of that artifact.

What is found there is untrusted: a pull takes a file only when `resume` is a real folder of this
user (walked without following links) and the file a regular one of this user with one link and
the expected size, opened without following a link; anything else is deleted (a link or a second
name unlinked, never written through) and its blocks downloaded again. Every block of a taken
file is checked by digest before it is trusted (oci_pull).
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from pipeline.format.bundle_folder import STAGING_DIR
from pipeline.format.errors import PipelineError
from pipeline.format.safe_tree import folder_fd, remove_entry_at, rename

RESUME_DIR = "resume"
_PART_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Resume:
    """The resume folder of one bundles folder."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.folder = self.root / STAGING_DIR / RESUME_DIR

    def name(self, digest: str) -> str:
        return f"{digest.split(':', 1)[1]}.part"

    def take(self, digest: str, dest: Path, size: int) -> int | None:
        """The partial file of `digest`, moved to dest and open for reading and writing; None
        when there is none this pull may use (one that is there but unfit is deleted)."""
        try:
            with folder_fd(self.root, (STAGING_DIR, RESUME_DIR)) as folder:
                if os.fstat(folder).st_uid != os.geteuid():
                    return None
                fd = _open_part(folder, self.name(digest), size)
                if fd is None:
                    return None
        except (OSError, PipelineError):  # none there, or `resume` is not a real folder
            return None
        try:
            rename(self.root, self.folder / self.name(digest), dest)
            st, there = os.fstat(fd), os.lstat(dest)
            if (st.st_dev, st.st_ino) == (there.st_dev, there.st_ino):
                return fd
            os.unlink(dest)  # swapped between the checks and the move: not the file checked
        except (OSError, PipelineError):
            pass
        os.close(fd)
        return None

    def keep(self, digest: str, partial: Path) -> None:
        """Keep a partial file for the next pull (best effort: resuming is an optimisation;
        never into a `resume` that is a link or another user's)."""
        try:
            with folder_fd(self.root, (STAGING_DIR, RESUME_DIR), create=True) as folder:
                if os.fstat(folder).st_uid != os.geteuid():
                    return
            rename(self.root, partial, self.folder / self.name(digest))
        except (OSError, PipelineError):
            pass

    def clear(self) -> None:
        """Remove the resume folder (a link there is unlinked, never followed)."""
        try:
            with folder_fd(self.root, (STAGING_DIR,)) as staging:
                remove_entry_at(staging, RESUME_DIR)
        except (OSError, PipelineError):
            pass


def _open_part(folder: int, name: str, size: int) -> int | None:
    """A descriptor of the partial file `name` when it is fit to resume into; an unfit one (a
    link, a second name of another file, not a regular file of this user, another size) is
    deleted."""
    try:
        fd = os.open(name, _PART_FLAGS, dir_fd=folder)
    except FileNotFoundError:
        return None
    except OSError:  # a link (ELOOP), or something that cannot be opened for writing
        _unlink(folder, name)
        return None
    st = os.fstat(fd)
    fit = stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid()
    if fit and st.st_size == size:
        return fd
    os.close(fd)
    _unlink(folder, name)
    return None


def _unlink(folder: int, name: str) -> None:
    with contextlib.suppress(OSError):
        remove_entry_at(folder, name)
