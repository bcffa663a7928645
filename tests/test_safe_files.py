"""The one safe tree's files and folders (pipeline.format.safe_files, safe_tree) on hostile input:
links, FIFOs, another writer's lock, a file that appears meanwhile, a full disk."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from pipeline.format import safe_files
from pipeline.format.regular_files import FileProblem
from pipeline.format.safe_files import (
    LockHeld,
    lock_at,
    not_private,
    put_in_place,
    read_at,
    stage_beside,
    write_new,
)
from pipeline.format.safe_tree import is_empty_at, remove_entry_at


def test_a_lock_is_taken_once_and_refuses_a_fifo_without_blocking(tmp_path: Path):
    fd = lock_at(None, tmp_path / "lock", create=True)
    assert fd is not None and oct(os.stat(tmp_path / "lock").st_mode & 0o777) == "0o600"
    with pytest.raises(LockHeld):
        lock_at(None, tmp_path / "lock", create=False)
    os.close(fd)
    os.close(lock_at(None, tmp_path / "lock", create=False))  # free again once closed
    assert lock_at(None, tmp_path / "missing", create=False) is None
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(FileProblem, match="is not a regular file"):
        lock_at(None, tmp_path / "fifo", create=False)
    os.symlink(tmp_path / "lock", tmp_path / "link")
    with pytest.raises(OSError) as exc:
        lock_at(None, tmp_path / "link", create=True)
    assert exc.value.errno == errno.ELOOP


def test_a_new_file_is_never_written_through_a_link_nor_over_a_file(tmp_path: Path):
    target = tmp_path / "target"
    target.write_bytes(b"theirs")
    os.symlink(target, tmp_path / "link")
    for name in ("link", "target"):
        with pytest.raises(OSError):
            write_new(tmp_path / name, b"mine")
    assert target.read_bytes() == b"theirs"
    write_new(tmp_path / "new", b"mine")
    assert oct(os.stat(tmp_path / "new").st_mode & 0o777) == "0o600"


def test_put_in_place_without_replace_keeps_a_file_that_appeared_meanwhile(tmp_path: Path):
    path = tmp_path / "key"
    tmp = stage_beside(path, b"new")
    path.write_bytes(b"first")
    with pytest.raises(FileExistsError):
        put_in_place(tmp, path, replace=False)
    assert path.read_bytes() == b"first"
    put_in_place(tmp, path, replace=True)
    assert path.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["key"]


def test_a_full_disk_leaves_no_staged_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safe_files.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        stage_beside(tmp_path / "memo.json", b"{}")
    assert list(tmp_path.iterdir()) == []


def test_not_private_says_what_is_wrong(tmp_path: Path):
    folder, file = tmp_path / "d", tmp_path / "f"
    folder.mkdir(mode=0o700)
    file.write_bytes(b"")
    os.chmod(file, 0o644)
    assert not_private(os.stat(folder), want_dir=True) is None
    assert not_private(os.stat(file), want_dir=True) == "kind"
    assert not_private(os.stat(file), want_dir=False) == "mode"
    assert not_private(os.stat(file), want_dir=False, forbidden=0o022) is None


def test_reads_and_removals_never_follow_a_link(tmp_path: Path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"x")
    tree = tmp_path / "tree"
    tree.mkdir()
    os.symlink(outside, tree / "folder-link")
    os.symlink(outside / "keep", tree / "file-link")
    os.mkfifo(tree / "fifo")
    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert read_at(fd, "file-link", 10) is None and read_at(fd, "fifo", 10) is None
        assert not is_empty_at(fd, "folder-link")
        for name in ("folder-link", "file-link", "fifo"):
            remove_entry_at(fd, name)
    finally:
        os.close(fd)
    assert list(tree.iterdir()) == [] and (outside / "keep").read_bytes() == b"x"
