"""serve --snapshots DIR changed while serve runs: the folder is held open from the start, and a
save into a DIR that is gone, replaced (by a link to a public folder, by another folder) or opened
to others writes nothing there and says so in one line; a bad --snapshot-budget is refused before
anything is loaded (pipeline.runtime.snapshot_store, pipeline.runtime.snapshots)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_snapshots import TOKENS, host, prefilled  # noqa: F401 - host: the fixture used below

from pipeline.format.errors import PipelineError
from pipeline.runtime import snapshot_store
from pipeline.runtime.snapshot_store import Entry
from pipeline.runtime.snapshots import DEFAULT_BUDGET, Snapshots

pytestmark = pytest.mark.usefixtures("host")  # a host key folder of each test's own
GONE = (
    "{root} is gone (removed or moved while serve ran); nothing saved; restart serve to save "
    "there again (it creates a missing folder)"
)
REPLACED = (
    "{root} is no longer the folder serve started with ({what}); not saved; restart serve to "
    "use what is there now (its checks run at the start)"
)


@pytest.fixture
def serving(tmp_path: Path, tiny_model: Path):
    """(DIR, Snapshots saving at every tick, holding set-1 already, a public 0777 folder)."""
    root, public = tmp_path / "snaps", tmp_path / "public"
    public.mkdir()
    os.chmod(public, 0o777)
    entry = Entry(TOKENS, prefilled(tiny_model, TOKENS), "test", False)
    # every capture after the first lists one more entry (a spill writes only what changed)
    shorter = [
        Entry(TOKENS[:n], prefilled(tiny_model, TOKENS[:n]), "test", False) for n in (50, 60, 70)
    ]
    listed = [[(1, entry)], *[[(1, entry), (2, e)] for e in shorter]]
    snaps = Snapshots(root, DEFAULT_BUDGET, tiny_model, None, "mlx-lm")
    snaps.spill_while_serving(0.0, lambda: listed.pop(0), lambda ids: 0, start=False)
    snaps.changed()
    assert snaps.spiller.spill()
    assert (root / "set-1").is_dir()
    yield root, snaps, entry, public
    snaps.close()


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


NEXT = "the next spill is tried after the next new entry, 0 s from now at the earliest"


def tick_error(snaps: Snapshots, caplog) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="prefix-bundles"):
        snaps.changed()  # the server's thread goes on
        assert not snaps.spiller.spill()  # the spill thread goes on
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]


def stop_error(snaps: Snapshots, entry: Entry) -> str:
    with pytest.raises(PipelineError) as exc:
        snaps.save([(9, entry)], lambda ids: 0)
    return str(exc.value)


def test_a_dir_replaced_by_a_link_to_a_public_folder_is_never_written(serving, caplog):
    root, snaps, entry, public = serving
    shutil.rmtree(root)
    root.symlink_to(public)
    why = REPLACED.format(root=root, what=f"it is now a symbolic link to {public}")
    assert tick_error(snaps, caplog) == [f"snapshots: spill failed: {why}; {NEXT}"]
    assert stop_error(snaps, entry) == f"snapshots: {why}"
    assert names(public) == []  # no client prompt in the public folder


def test_a_dir_replaced_by_another_private_folder_is_not_written(serving, caplog):
    root, snaps, entry, _ = serving
    shutil.rmtree(root)
    root.mkdir(mode=0o700)
    why = REPLACED.format(root=root, what="another folder is there now")
    assert tick_error(snaps, caplog) == [f"snapshots: spill failed: {why}; {NEXT}"]
    assert stop_error(snaps, entry) == f"snapshots: {why}"
    assert names(root) == []  # not even a lock: a later serve locks it and saves there


@pytest.mark.parametrize("how", ["removed", "moved"])
def test_a_removed_dir_is_said_to_be_gone_not_kept(serving, caplog, how):
    root, snaps, entry, _ = serving
    if how == "removed":
        shutil.rmtree(root)
    else:
        root.rename(root.with_name("moved"))
    why = GONE.format(root=root)
    assert tick_error(snaps, caplog) == [f"snapshots: spill failed: {why}; {NEXT}"]
    assert "stays" not in caplog.text  # the previous set is gone with the folder
    assert stop_error(snaps, entry) == f"snapshots: {why}"
    assert not root.exists()
    if how == "moved":  # the held folder: the set it had, untouched
        assert names(root.with_name("moved")) == [".lock", "set-1"]


def test_a_dir_opened_to_others_while_serving_is_not_written(serving, caplog):
    root, snaps, entry, _ = serving
    os.chmod(root, 0o777)
    why = (
        f"{root} is now open to other users (mode 0777, uid {os.getuid()}); not saved: snapshots "
        "hold client prompts; make it yours with mode 0700 again"
    )
    assert tick_error(snaps, caplog) == [f"snapshots: spill failed: {why}; {NEXT}"]
    assert stop_error(snaps, entry) == f"snapshots: {why}"
    assert names(root) == [".lock", "set-1"]
    os.chmod(root, 0o700)
    snaps.save([(9, entry)], lambda ids: 0)  # its own folder again: saved
    assert names(root) == [".lock", "set-2"]


def test_a_swap_during_the_save_leaves_nothing_in_either_folder(
    serving, monkeypatch: pytest.MonkeyPatch
):
    root, snaps, entry, public = serving
    held, write = root.with_name("held"), snapshot_store.write_snapshot

    def swapped_after(parent, rank, e, context, key):
        folder = write(parent, rank, e, context, key)
        root.rename(held)  # the snapshot is written; DIR is swapped before the rename
        root.symlink_to(public)
        return folder

    monkeypatch.setattr(snapshot_store, "write_snapshot", swapped_after)
    message = stop_error(snaps, entry)
    assert message.startswith(f"snapshots: {root} is no longer the folder serve started with")
    assert names(public) == []
    assert names(held) == [".lock", "set-1"]  # the staging folder was removed, through the fd


def test_the_lock_stays_with_the_held_folder(serving, tiny_model: Path):
    root, _, _, _ = serving
    held = root.with_name("held")
    root.rename(held)
    root.mkdir(mode=0o700)
    Snapshots(root, DEFAULT_BUDGET, tiny_model, None, "mlx-lm").close()  # not what serve holds
    with pytest.raises(PipelineError, match="is in use by another serve process"):
        Snapshots(held, DEFAULT_BUDGET, tiny_model, None, "mlx-lm")


# --- --snapshot-budget before anything is loaded --------------------------------------------

NOT_A_SIZE = (
    "--snapshot-budget '2 lots' is not a size; write bytes or a number with KiB, MiB, GiB or "
    "TiB (e.g. 2GiB)"
)


def test_the_budget_is_checked_on_its_own():
    from pipeline.runtime.servers.options import snapshot_budget

    options = SimpleNamespace(snapshots=Path("s"), snapshot_budget="2 lots")
    with pytest.raises(PipelineError) as exc:
        snapshot_budget(options)
    assert str(exc.value) == NOT_A_SIZE
    assert snapshot_budget(SimpleNamespace(snapshots=Path("s"), snapshot_budget="512MiB")) == (
        512 << 20
    )
    # given without --snapshots it was ignored, and an empty one taken as the default
    with pytest.raises(PipelineError, match=r"^--snapshot-budget needs --snapshots DIR"):
        snapshot_budget(SimpleNamespace(snapshots=None, snapshot_budget="1GiB"))
    with pytest.raises(PipelineError, match=r"^--snapshot-budget '' is not a size"):
        snapshot_budget(SimpleNamespace(snapshots=Path("s"), snapshot_budget=""))
    assert snapshot_budget(SimpleNamespace(snapshots=None, snapshot_budget=None)) is None
    assert snapshot_budget(SimpleNamespace(snapshots=Path("s"), snapshot_budget=None)) == 2 << 30


def test_a_bad_budget_is_refused_before_the_mount(
    tmp_path: Path, tiny_model: Path, capsys, monkeypatch: pytest.MonkeyPatch
):
    from pipeline.cli import main
    from pipeline.runtime.servers import startup

    def mount_for(*args, **kwargs):
        raise AssertionError("mounted before the budget was checked")

    monkeypatch.setattr(startup, "mount_for", mount_for)
    args = ["serve", "--model", str(tiny_model), "--snapshots", str(tmp_path / "s")]
    assert main([*args, "--snapshot-budget", "2 lots"]) == 2  # usage
    assert capsys.readouterr().err == f"error: {NOT_A_SIZE}\n"
