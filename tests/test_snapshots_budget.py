"""The snapshot budget bounds what a start loads (issue 48, finding 4): every manifest is read
first, and only the snapshots kept are loaded; links and copies of one snapshot, and what does
not fit the budget, are left out before any tensor is read (pipeline.runtime.snapshot_restore)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from test_snapshots import TOKENS, host, prefilled  # noqa: F401 - host: fixture
from test_snapshots_restore import OTHER, save, snapshots_in

from pipeline.format.bundle_folder import MANIFEST_FILE
from pipeline.format.manifest import Manifest
from pipeline.runtime import snapshot_store
from pipeline.runtime.snapshot_store import Entry
from pipeline.runtime.snapshots import Snapshots

pytestmark = pytest.mark.usefixtures("host")


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The snapshots whose tensors the start read (the real validator, counted)."""
    seen, real = [], snapshot_store.validate

    def counted(path: Path, *args, **kwargs):
        if kwargs.get("load"):
            seen.append(Path(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(snapshot_store, "validate", counted)
    return seen


def restored(root: Path, model: Path, budget: int, caplog) -> Snapshots:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="prefix-bundles"):
        snaps = Snapshots(root, budget, model, None, "mlx-lm")
        snaps.restore([])
    return snaps


def test_links_of_one_snapshot_are_loaded_once(tmp_path: Path, tiny_model: Path, loads, caplog):
    root = tmp_path / "snaps"
    folder = save(root, tiny_model, [Entry(TOKENS, prefilled(tiny_model, TOKENS), "t", False)])
    (first,) = snapshots_in(folder)
    for i in range(1, 30):  # 29 hard links of it (no extra disk), colder ranks
        copy = folder / f"{i:02d}-{first.name[3:]}"
        copy.mkdir(mode=0o700)
        for f in first.iterdir():
            os.link(f, copy / f.name)
    size = Manifest.model_validate_json((first / MANIFEST_FILE).read_bytes()).cache.nbytes
    snaps = restored(root, tiny_model, 8 * size, caplog)
    assert loads == [first] and len(snaps) == 1
    assert "restored 1 of 30" in caplog.text
    assert "left out: 29 held by a bundle or a hotter snapshot" in caplog.text


def test_what_does_not_fit_the_budget_is_never_loaded(
    tmp_path: Path, tiny_model: Path, loads, caplog
):
    root = tmp_path / "snaps"
    third = [(3 * i + 2) % 800 + 25 for i in range(150)]
    entries = [Entry(t, prefilled(tiny_model, t), "t", False) for t in (TOKENS, OTHER, third)]
    folder = save(root, tiny_model, entries)
    hottest = snapshots_in(folder)[0]
    size = Manifest.model_validate_json((hottest / MANIFEST_FILE).read_bytes()).cache.nbytes
    snaps = restored(root, tiny_model, size + 1, caplog)
    assert loads == [hottest] and len(snaps) == 1
    assert "restored 1 of 3" in caplog.text and "left out: 2 over the budget" in caplog.text
