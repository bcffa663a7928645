"""A validated bundle's files, held to the ones the validator read.

`file_ids` records every file's identity (memo.file_identity: size, mtime, ctime, inode, device,
what the hash memo trusts) around validation; `Pinned` opens each file once (no link followed), refuses one that is
not that file, serves its bytes from the descriptor only, and `check` looks again (the open file
and the name) right before the tag moves. A bundle rebuilt or edited while it is pushed is then
one line, and its tag keeps the artifact it had.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.distribute.blocks import open_regular
from pipeline.format.errors import PipelineError
from pipeline.format.memo import file_identity

FileId = tuple[int, int, int, int, int]
file_id = file_identity  # (size, mtime, ctime, inode, device): what the hash memo trusts


def file_ids(folder: Path) -> tuple[tuple[str, FileId], ...]:
    """(name, identity) of each entry of folder, links not followed, by name."""
    with os.scandir(folder) as found:
        return tuple(sorted((e.name, file_id(e.stat(follow_symlinks=False))) for e in found))


class Pinned:
    """The named files of a bundle, open, each the one recorded in `ids`; close() when done."""

    def __init__(self, folder: Path, ids: dict[str, FileId], names: list[str], label: str):
        self.folder, self.ids, self.label = Path(folder), ids, label
        self.fds: dict[str, int] = {}
        try:
            for name in names:
                self.fds[name] = fd = self._open(name)
                self._same(name, os.fstat(fd))
        except BaseException:
            self.close()
            raise

    def _open(self, name: str) -> int:
        try:
            return open_regular(self.folder / name)
        except OSError:
            raise self.changed(name) from None

    def _same(self, name: str, st: os.stat_result) -> None:
        if self.ids.get(name) != file_id(st):
            raise self.changed(name)

    def changed(self, name: str) -> PipelineError:
        return PipelineError(
            f"bundle {self.label}: the bundle changed while it was pushed ({name} is not the "
            "file validated); push again. Its tag was not moved"
        )

    def size(self, name: str) -> int:
        """The validated file's size (its identity's first number)."""
        return self.ids[name][0]

    def read(self, name: str) -> bytes:
        """A small file's bytes, whole."""
        fd = self.fds[name]
        size = self.size(name)
        data = os.pread(fd, size, 0)
        if len(data) != size:
            raise self.changed(name)
        return data

    def check(self) -> None:
        """Every file still the one validated, open and by its name (before the tag moves)."""
        for name, fd in self.fds.items():
            self._same(name, os.fstat(fd))
            try:
                self._same(name, os.stat(self.folder / name, follow_symlinks=False))
            except OSError:
                raise self.changed(name) from None

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}
