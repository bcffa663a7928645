"""What serve's restore of --snapshots DIR leaves out or refuses, and what it never touches: the
byte budget holds at the start too (hottest first, copies once), the server's options are asked
as for a bundle, one unreadable set costs only itself, folders serve did not write stay as they
are, quantized KV is always recorded lossy, and nothing a name holds breaks a one-line log
(pipeline.runtime.snapshots, snapshot_store, snapshot_key)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from test_snapshots import TOKENS, host, prefilled, restore, save_one  # noqa: F401 - host: fixture

from pipeline.format.bundle_folder import MANIFEST_FILE
from pipeline.format.errors import PipelineError
from pipeline.format.manifest import Manifest
from pipeline.runtime.servers.mlx_lm import Hook
from pipeline.runtime.servers.options import ServeOptions
from pipeline.runtime.snapshot_key import host_key
from pipeline.runtime.snapshot_store import SET_MARK, Entry, SnapshotFolder
from pipeline.runtime.snapshots import DEFAULT_BUDGET, Snapshots, open_snapshots

pytestmark = pytest.mark.usefixtures("host")  # a host key folder of each test's own
OTHER = [(5 * i + 1) % 800 + 20 for i in range(200)]


def save(root: Path, model: Path, entries: list[Entry]) -> Path:
    """One set of `entries` (hottest first) written by serve's code; the set folder."""
    snaps = Snapshots(root, DEFAULT_BUDGET, model, None, "mlx-lm")
    snaps.save([(len(entries) - i, e) for i, e in enumerate(entries)], lambda ids: 0)
    snaps.close()
    listing = SnapshotFolder(root, listing=True)
    (found,) = listing.sets()
    listing.close()
    return found[1]


def snapshots_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name != SET_MARK)


def quantized(model: Path, tokens: list[int]) -> list:
    return [layer.to_quantized(group_size=32, bits=4) for layer in prefilled(model, tokens)]


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_restore_keeps_to_the_budget_hottest_first_and_a_copied_snapshot_once(
    tmp_path: Path, tiny_model: Path, caplog
):
    root = tmp_path / "snaps"
    hot, cold = Entry(TOKENS, prefilled(tiny_model, TOKENS), "test", False), None
    cold = Entry(OTHER, prefilled(tiny_model, OTHER), "test", False)
    folder = save(root, tiny_model, [hot, cold])
    first = snapshots_in(folder)[0]
    shutil.copytree(first, folder / f"02-{first.name[3:]}")  # the hottest, twice in the set
    size = Manifest.model_validate_json((first / MANIFEST_FILE).read_bytes()).cache.nbytes
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="prefix-bundles"):
        snaps = Snapshots(root, size + size // 2, tiny_model, None, "mlx-lm")
        snaps.restore([])
    assert (
        f"restored 1 of 3 from {folder} (300 tokens, " in caplog.text
        and "0 refused, left out: 1 held by a bundle or a hotter snapshot, 1 over the budget"
        in caplog.text
    )
    assert len(snaps) == 1 and snaps.covered([*TOKENS, 5]) == 300 and snaps.covered(OTHER) == 0


def test_a_snapshot_the_servers_options_cannot_use_is_refused_as_a_bundle_is(
    tmp_path: Path, tiny_model: Path, caplog
):
    root = tmp_path / "snaps"
    save_one(root, tiny_model)  # full precision: kept under any --kv-bits
    folder = save(root, tiny_model, [Entry(OTHER, quantized(tiny_model, OTHER), "test", True)])
    (four_bit,) = snapshots_in(folder)
    mounted = SimpleNamespace(result=SimpleNamespace(bundles=[]))

    def opened(rest: tuple[str, ...]) -> Snapshots:
        caplog.clear()
        options = ServeOptions("mlx-lm", tiny_model, tmp_path / "b", rest, (), True)
        options = options.__class__(**{**options.__dict__, "snapshots": root})
        with caplog.at_level(logging.INFO, logger="prefix-bundles"):
            return open_snapshots(options, mounted, Hook())

    snaps = opened(("--kv-bits", "8"))
    assert f"refused snapshot {four_bit}: --kv-bits 8 asks for 8-bit KV but the bundle holds " \
        "4-bit KV" in caplog.text  # fmt: skip
    assert "restored 0 of 1" in caplog.text and "1 refused" in caplog.text and len(snaps) == 0
    snaps.close()
    snaps = opened(("--kv-bits", "4"))
    assert "restored 1 of 1" in caplog.text and len(snaps) == 1
    snaps.close()


def test_quantized_kv_is_recorded_lossy_and_a_manifest_saying_otherwise_is_refused(
    tmp_path: Path, tiny_model: Path
):
    # a hook that gets lossiness wrong cannot write a lossless quantized snapshot
    folder = save(tmp_path / "snaps", tiny_model, [Entry(OTHER, quantized(tiny_model, OTHER), "t", False)])  # fmt: skip
    (snapshot,) = snapshots_in(folder)
    data = json.loads((snapshot / MANIFEST_FILE).read_text())
    assert data["snapshot"]["lossy"] is True and data["cache"]["kv_bits"] == 4
    data["snapshot"]["lossy"] = False  # what a holder of the host key could sign
    with pytest.raises(ValidationError, match="snapshot.lossy is false for 4-bit KV"):
        Manifest.model_validate(data)


def test_an_unreadable_set_costs_only_itself(tmp_path: Path, tiny_model: Path, caplog, monkeypatch):
    root = tmp_path / "snaps"
    save_one(root, tiny_model)
    shutil.copytree(root / "set-1", root / "set-2")  # the newer set, unreadable (mode 000)
    iterdir = Path.iterdir

    def unreadable(self: Path):
        if self == root / "set-2":
            raise PermissionError(13, "Permission denied")
        return iterdir(self)

    monkeypatch.setattr(Path, "iterdir", unreadable)
    restore(root, tiny_model, caplog).close()
    assert f"refused snapshot {root / 'set-2'}: cannot be read (Permission denied)" in caplog.text
    assert f"restored 1 of 1 from {root / 'set-1'} " in caplog.text


def test_folders_serve_did_not_write_are_never_removed(tmp_path: Path, tiny_model: Path, caplog):
    root = tmp_path / "snaps"
    save_one(root, tiny_model)
    theirs = ["set-2", "set-7", ".staging-old", ".staging-1-2"]  # an operator's own folders
    for name in theirs:
        (root / name / "data").mkdir(parents=True)
        (root / name / "data" / "results.csv").write_text("keep me\n")
    snaps = restore(root, tiny_model, caplog)
    assert f"restored 1 of 1 from {root / 'set-1'} " in caplog.text
    for name in ("set-2", "set-7", ".staging-1-2"):
        assert f"{root / name} was not written by serve (it has no {SET_MARK})" in caplog.text
    snaps.save([], lambda ids: 0)
    snaps.close()
    left = sorted(p.name for p in root.iterdir())
    assert left == sorted([".lock", "set-3", *theirs])  # set-1 replaced by the new set
    assert all((root / n / "data" / "results.csv").read_text() == "keep me\n" for n in theirs)


def test_a_lock_that_is_not_a_regular_file_is_refused_without_waiting(tmp_path: Path):
    root = tmp_path / "snaps"
    root.mkdir(mode=0o700)
    os.mkfifo(root / ".lock")
    outcome: list[str] = []

    def open_folder(listing: bool) -> None:
        try:
            SnapshotFolder(root, listing=listing)
        except PipelineError as exc:
            outcome.append(str(exc))

    for listing in (False, True):  # serve, and prune's dry run
        worker = threading.Thread(target=open_folder, args=(listing,), daemon=True)
        worker.start()
        worker.join(10)
        assert not worker.is_alive(), "opening DIR blocked on a FIFO .lock"
    assert (
        outcome
        == [f"--snapshots {root}: .lock is not a regular file; remove it (serve makes it)"] * 2
    )


def test_a_name_with_a_newline_stays_on_one_log_line(tmp_path: Path, tiny_model: Path, caplog):
    root = tmp_path / "snaps"
    folder = save_one(root, tiny_model)
    forged = "99-x\n2026-01-01 00:00:00 - INFO - snapshots: restored 9 of 9"
    shutil.copytree(folder, folder.parent / forged)
    (folder.parent / "98-a\nfile").write_text("x")
    (root / "notes\nINFO - forged").write_text("x")
    restore(root, tiny_model, caplog).close()
    assert "restored 1 of 3" in caplog.text
    assert all("\n" not in m for m in messages(caplog)), messages(caplog)
    assert "98-a\\nfile: not a bundle folder (it is a regular file)" in caplog.text


def test_a_leftover_key_file_of_a_killed_first_start_does_not_block_the_key(host: Path):  # noqa: F811
    host.parent.mkdir(parents=True, mode=0o700)
    (host.parent / f".{host.name}.{os.getpid()}.tmp").write_text("half a key")
    first = host_key()
    assert host_key().public_key().key_id == first.public_key().key_id
