"""serve's --snapshots DIR on disk: a failed write is one line and keeps the previous set; what is
not a proper set (a file, a link, a name out of range, an empty or foreign set) is skipped with a
warning and never costs the newest good set; DIR is made private or refused, never chmod-ed, and a
listing changes nothing (pipeline.runtime.snapshot_store)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_snapshots import TOKENS, host, prefilled, restore, save_one  # noqa: F401 - host: fixture

from pipeline.cli import main
from pipeline.format import bundle_writer
from pipeline.format.errors import PipelineError
from pipeline.runtime import snapshot_store
from pipeline.runtime.snapshot_store import MARK_TEXT, SET_MARK, Entry
from pipeline.runtime.snapshots import DEFAULT_BUDGET, Snapshots

pytestmark = pytest.mark.usefixtures("host")  # a host key folder of each test's own
HERE = Path(__file__).parent


def files(root: Path) -> dict[str, bytes]:
    """Every regular file under `root` (links not followed), by relative path."""
    found = {}
    for top, _, names in os.walk(root):
        for name in names:
            path = Path(top, name)
            if path.is_file() and not path.is_symlink():
                found[str(path.relative_to(root))] = path.read_bytes()
    return found


def set_two(root: Path, model: Path) -> Path:
    """A valid set numbered 2 (written as set-1, renamed): the set serve must keep."""
    save_one(root, model)
    (root / "set-1").rename(root / "set-2")
    return root / "set-2"


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


# --- 5: a write that fails (a full disk) ----------------------------------------------------

FULL_DISK = """
import resource, signal, sys
from pipeline.format.errors import PipelineError
from pipeline.runtime.snapshots import DEFAULT_BUDGET, Snapshots
from test_snapshots import TOKENS, prefilled
from pipeline.runtime.snapshot_store import MARK_TEXT, SET_MARK, Entry
root, model = sys.argv[1], sys.argv[2]
entry = Entry(TOKENS, prefilled(model, TOKENS), "test", False)
snaps = Snapshots(root, DEFAULT_BUDGET, model, None, "mlx-lm")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
try:
    snaps.save([(1, entry)], lambda ids: 0)
except PipelineError as exc:
    print(exc)
"""


def test_a_full_disk_at_the_stop_is_one_line_and_the_previous_set_stays(
    tmp_path: Path, tiny_model: Path
):
    root = tmp_path / "snaps"
    save_one(root, tiny_model)
    before = files(root / "set-1")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [HERE, HERE.parent]))}
    run = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(root), str(tiny_model)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert run.stdout.startswith(
        f"snapshots: the new set was not saved under {root} (RuntimeError: [write] Unable to write "
    ), run.stdout
    assert run.stdout.endswith(
        f"bytes to file.: the disk is full or cannot be written); the previous set "
        f"{root / 'set-1'} stays; free space there or lower --snapshot-budget\n"
    ), run.stdout
    assert names(root) == [".lock", "set-1"] and files(root / "set-1") == before


def test_the_error_mlx_raises_on_a_full_disk_is_one_message(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
):
    root = tmp_path / "snaps"
    snaps = Snapshots(root, DEFAULT_BUDGET, tiny_model, None, "mlx-lm")

    def full(path, cache, metadata):
        Path(path).write_bytes(b"half")
        raise RuntimeError("[write] Unable to write 404982 bytes to file.")

    monkeypatch.setattr(bundle_writer, "write_cache", full)
    entry = Entry(TOKENS, prefilled(tiny_model, TOKENS), "test", False)
    with pytest.raises(PipelineError) as exc:
        snaps.save([(1, entry)], lambda ids: 0)
    assert str(exc.value) == (
        f"snapshots: the new set was not saved under {root} (RuntimeError: [write] Unable to "
        "write 404982 bytes to file.: the disk is full or cannot be written); no set was saved "
        "before; free space there or lower --snapshot-budget"
    )
    assert names(root) == [".lock"]
    snaps.close()


# --- 6: what is not a proper set ------------------------------------------------------------


def test_a_file_named_as_a_set_is_skipped_and_the_good_set_kept(
    tmp_path: Path, tiny_model: Path, caplog, capsys
):
    root = tmp_path / "snaps"
    good = set_two(root, tiny_model)
    (root / "set-3").write_text("not a set")
    snaps = restore(root, tiny_model, caplog)
    assert f"snapshots: restored 1 of 1 from {good} " in caplog.text
    assert f"snapshots: {root / 'set-3'} is not a folder; skipped (left as it is)" in caplog.text
    assert [r.levelname for r in caplog.records if "set-3" in r.getMessage()] == ["WARNING"]
    snaps.save([], lambda ids: 0)  # the restored snapshot is saved again, as the next set
    snaps.close()
    assert names(root) == [".lock", "set-3", "set-4"]
    assert main(["prune", "--snapshots", str(root)]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == f"would delete {root / 'set-4'}"
    assert err == f"warning: {root / 'set-3'} is not a folder; skipped (left as it is)\n"
    assert main(["prune", "--snapshots", str(root), "--apply"]) == 0
    assert capsys.readouterr().out.startswith(f"deleted 1 folder under {root}")
    assert names(root) == [".lock", "set-3"]


def test_an_empty_set_out_of_range_neither_costs_the_good_set_nor_leaves_the_range(
    tmp_path: Path, tiny_model: Path, caplog
):
    root = tmp_path / "snaps"
    good = set_two(root, tiny_model)
    (root / "set-999999999").mkdir()
    (root / "set-999999999" / SET_MARK).write_bytes(MARK_TEXT)  # serve's, with no snapshot
    snaps = restore(root, tiny_model, caplog)
    assert f"snapshots: {root / 'set-999999999'} holds no snapshot; skipped" in caplog.text
    assert f"snapshots: restored 1 of 1 from {good} " in caplog.text
    with caplog.at_level(logging.INFO, logger="prefix-bundles"):
        snaps.save([], lambda ids: 0)
    snaps.close()
    assert f"to {root / 'set-1'} in " in caplog.text  # the free name in range
    assert names(root) == [".lock", "set-1"]
    assert (
        "restored 1 of 1 from" in caplog.text and restore(root, tiny_model, caplog).close() is None
    )
    assert f"restored 1 of 1 from {root / 'set-1'} " in caplog.text


def test_a_failed_publish_leaves_no_staging_and_the_next_save_works(
    tmp_path: Path, tiny_model: Path, caplog, monkeypatch: pytest.MonkeyPatch
):
    root = tmp_path / "snaps"
    save_one(root, tiny_model)
    snaps = restore(root, tiny_model, caplog)

    def refuse(src, dst):
        raise OSError(39, "Directory not empty", str(src))

    monkeypatch.setattr(snapshot_store.os, "rename", refuse)
    with pytest.raises(PipelineError, match="the previous set .*set-1 stays"):
        snaps.save([], lambda ids: 0)
    assert names(root) == [".lock", "set-1"]
    monkeypatch.undo()
    snaps.save([], lambda ids: 0)
    snaps.close()
    assert names(root) == [".lock", "set-2"]


def test_a_link_in_the_folder_is_never_followed(tmp_path: Path, tiny_model: Path, caplog, capsys):
    root = tmp_path / "snaps"
    good = set_two(root, tiny_model)
    outside = tmp_path / "outside"
    (outside / "00-x").mkdir(parents=True)
    (outside / "00-x" / "big").write_bytes(b"x" * 3_000_000)
    (root / "set-7").symlink_to(outside)
    (root / ".staging-1-2").symlink_to(outside)
    assert main(["prune", "--snapshots", str(root)]) == 0
    out, err = capsys.readouterr()
    size = sum(map(len, files(good).values())) / 2**20
    assert out.splitlines() == [
        f"would delete {good}",
        f"1 snapshot set, {size:,.1f} MiB; pass --apply to delete",
    ]
    assert f"warning: {root / 'set-7'} is a symbolic link (never followed); skipped" in err
    snaps = restore(root, tiny_model, caplog)
    snaps.close()
    assert f"restored 1 of 1 from {good} " in caplog.text
    assert "refused snapshot" not in caplog.text and "0 refused" in caplog.text
    assert main(["prune", "--snapshots", str(root), "--apply"]) == 0
    assert names(root) == [".lock", ".staging-1-2", "set-7"]
    assert files(outside) == {"00-x/big": b"x" * 3_000_000}


def test_a_set_of_another_host_does_not_cost_the_good_set(
    tmp_path: Path, tiny_model: Path, caplog, monkeypatch: pytest.MonkeyPatch
):
    root = tmp_path / "snaps"
    good = set_two(root, tiny_model)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "other-host"))
    save_one(tmp_path / "other", tiny_model)
    shutil.copytree(tmp_path / "other" / "set-1", root / "set-9")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    snaps = restore(root, tiny_model, caplog)
    assert "which is not trusted" in caplog.text
    assert (
        f"snapshots: none of the 1 snapshot in {root / 'set-9'} mounts; skipped, the older "
        "sets are tried"
    ) in caplog.text
    assert f"snapshots: restored 1 of 1 from {good} " in caplog.text
    assert len(snaps) == 1
    snaps.save([], lambda ids: 0)
    snaps.close()
    assert names(root) == [".lock", "set-10"]


def test_one_start_with_another_model_costs_no_good_set(
    tmp_path: Path, tiny_model: Path, tiny_model_other_weights: Path, caplog, monkeypatch
):
    """A serve started once with the wrong model (or an mlx-lm later rolled back) refused every
    snapshot, rightly, then at its stop saved its own set and removed the good one: the next
    start with the right model restored nothing. Now its set is saved beside the good one, and a
    stop with nothing to save writes nothing and removes nothing."""
    root = tmp_path / "snaps"
    good = set_two(root, tiny_model)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "other-host"))
    save_one(tmp_path / "other", tiny_model)  # and a newer set copied in from another host
    shutil.copytree(tmp_path / "other" / "set-1", root / "set-9")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    other = tiny_model_other_weights
    snaps = restore(root, other, caplog)
    assert f"restored 0 of 1 from {root / 'set-9'}" in caplog.text
    with caplog.at_level(logging.INFO, logger="prefix-bundles"):
        snaps.save([], lambda ids: 0)
    assert f"snapshots: nothing to save; the sets in {root} stay" in caplog.text
    assert names(root) == [".lock", "set-2", "set-9"]
    snaps.save([(1, Entry(TOKENS, prefilled(other, TOKENS), "test", False))], lambda ids: 0)
    snaps.close()
    assert names(root) == [".lock", "set-10", "set-2", "set-9"]  # the good set stays
    restore(root, tiny_model, caplog).close()
    assert f"restored 1 of 1 from {good} " in caplog.text


# --- 7: DIR is private or refused, never chmod-ed -------------------------------------------


def shared(path: Path, mode: int = 0o1777) -> Path:
    path.mkdir()
    os.chmod(path, mode)
    return path


OPEN = (
    "--snapshots {} is open to other users (mode {}); snapshots hold client prompts: pass a "
    "folder of your own that only you can read (serve creates a missing one with mode 0700)"
)


@pytest.mark.parametrize("mode", [0o1777, 0o750, 0o701], ids=oct)
def test_a_folder_open_to_others_is_refused_never_chmod_ed(
    tmp_path: Path, tiny_model: Path, capsys, mode: int
):
    folder = shared(tmp_path / "shared2", mode)
    assert main(["prune", "--snapshots", str(folder)]) == 1
    assert capsys.readouterr().err == f"error: {OPEN.format(folder, f'{mode:04o}')}\n"
    link = tmp_path / "snaplink"
    link.symlink_to(folder)
    with pytest.raises(PipelineError) as exc:
        Snapshots(link, DEFAULT_BUDGET, tiny_model, None, "mlx-lm")
    assert str(exc.value) == OPEN.format(link, f"{mode:04o}")
    assert os.stat(folder).st_mode & 0o7777 == mode and names(folder) == []


def test_a_listing_changes_nothing(tmp_path: Path, capsys):
    folder = tmp_path / "snaps"
    folder.mkdir(mode=0o700)
    assert main(["prune", "--snapshots", str(folder)]) == 0
    assert capsys.readouterr().out == "0 snapshot sets, 0.0 MiB; pass --apply to delete\n"
    assert names(folder) == []


def test_a_file_as_dir_is_one_line(tmp_path: Path, tiny_model: Path):
    (tmp_path / "dirfile").write_text("")
    with pytest.raises(PipelineError) as exc:
        Snapshots(tmp_path / "dirfile", DEFAULT_BUDGET, tiny_model, None, "mlx-lm")
    assert str(exc.value) == (
        f"--snapshots {tmp_path / 'dirfile'} is not a folder; pass a folder (serve creates a "
        "missing one)"
    )


def test_a_folder_serve_creates_is_private(tmp_path: Path, tiny_model: Path):
    root = tmp_path / "new" / "snaps"
    Snapshots(root, DEFAULT_BUDGET, tiny_model, None, "mlx-lm").close()
    assert os.stat(root).st_mode & 0o7777 == 0o700 and names(root) == [".lock"]


@pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user needs root")
def test_a_folder_of_another_user_is_refused(tmp_path: Path, capsys):
    folder = shared(tmp_path / "theirs", 0o700)
    os.chown(folder, 12345, 12345)
    assert main(["prune", "--snapshots", str(folder)]) == 1
    assert capsys.readouterr().err == (
        f"error: --snapshots {folder} belongs to uid 12345, not this user; snapshots hold client "
        "prompts: pass a folder of your own that only you can read (serve creates a missing one "
        "with mode 0700)\n"
    )
    assert os.stat(folder).st_uid == 12345 and names(folder) == []


def test_a_lock_file_that_is_a_link_is_not_followed(tmp_path: Path, capsys):
    folder = shared(tmp_path / "snaps", 0o700)
    (folder / ".lock").symlink_to(tmp_path / "elsewhere")
    assert main(["prune", "--snapshots", str(folder), "--apply"]) == 1
    assert capsys.readouterr().err == (
        f"error: --snapshots {folder}: .lock cannot be opened (Too many levels of symbolic "
        "links); remove it\n"
    )
    assert not (tmp_path / "elsewhere").exists()
