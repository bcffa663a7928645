"""serve --snapshot-every MINUTES: the set saved while serving, from the hook's `tick` on the
thread that stores the entries, atomically (a failed save keeps the previous set and never reaches
the server); refused before anything is loaded where serve cannot guarantee that thread. The real
mlx_lm.server saves and a crash keeps the set: tests/test_snapshots.py (slow)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_snapshots import TOKENS, host, prefilled  # noqa: F401 - host: the fixture used below

from pipeline.format.errors import PipelineError
from pipeline.runtime import snapshot_store
from pipeline.runtime.servers import hook_for
from pipeline.runtime.servers.options import every_seconds
from pipeline.runtime.snapshot_store import Entry
from pipeline.runtime.snapshots import DEFAULT_BUDGET, Snapshots

pytestmark = pytest.mark.usefixtures("host")  # a host key folder of each test's own
UNSUPPORTED = (
    "--snapshot-every is not supported with --server {} yet: a save while it serves must run on "
    "the thread that owns its prompt cache, which serve guarantees for mlx_lm.server only "
    "(docs/snapshots.md); serve without it (the snapshots are still saved at a graceful stop)"
)
EVERY = [
    ("5", "mlx-lm", Path("s"), 300.0),
    ("0.5", "mlx-lm", Path("s"), 30.0),
    (None, "vllm-mlx", Path("s"), None),
    ("5", "mlx-lm", None, "--snapshot-every needs --snapshots DIR (the folder it saves to)"),
    (
        "0",
        "mlx-lm",
        Path("s"),
        "--snapshot-every '0' is not a number of minutes; pass a positive "
        "number (e.g. 5, or 0.5 for 30 seconds)",
    ),  # fmt: skip
    ("soon", "mlx-lm", Path("s"), "--snapshot-every 'soon' is not a number of minutes"),
    *[
        ("5", s, Path("s"), UNSUPPORTED.format(s))
        for s in ("vllm-mlx", "rapid-mlx", "mlx-omni-server", "mlx-openai-server")
    ],  # fmt: skip
]


@pytest.mark.parametrize("text, server, folder, expected", EVERY)
def test_snapshot_every_is_checked_before_anything_loads(text, server, folder, expected):
    options = SimpleNamespace(snapshot_every=text, snapshots=folder)
    if not isinstance(expected, str):
        assert every_seconds(options, hook_for(server)) == expected
        return
    with pytest.raises(PipelineError) as exc:
        every_seconds(options, hook_for(server))
    assert str(exc.value).startswith(expected)


def test_the_cli_refuses_it_with_one_line(tmp_path: Path, tiny_model: Path, capsys):
    from pipeline.cli import main

    args = ["serve", "--server", "rapid-mlx", "--model", str(tiny_model), "--snapshots"]
    assert main([*args, str(tmp_path / "s"), "--snapshot-every", "5"]) == 2  # usage
    assert capsys.readouterr().err == f"error: {UNSUPPORTED.format('rapid-mlx')}\n"
    assert not (tmp_path / "s").exists()  # refused before the folder was made


def periodic(root: Path, model: Path, listing, ticks: int = 0) -> Snapshots:
    """Snapshots saving at every tick (a period of 0 s) after `ticks` without, listing what
    `listing()` returns."""
    snaps = Snapshots(root, DEFAULT_BUDGET, model, None, "mlx-lm")
    for _ in range(ticks):
        snaps.tick()
    snaps.save_every(0.0, listing, lambda ids: 0)
    return snaps


def test_a_tick_saves_the_set_and_the_entry_being_stored_is_the_hottest(
    tmp_path: Path, tiny_model: Path, caplog
):
    cache = prefilled(tiny_model, TOKENS)
    old = Entry(TOKENS[:100], prefilled(tiny_model, TOKENS[:100]), "test", False)
    new = Entry([*TOKENS[:50], 3, 4], prefilled(tiny_model, [*TOKENS[:50], 3, 4]), "test", False)
    # stamp 0: the entry whose tick this is (the hook stamps it after the tick returns)
    snaps = periodic(tmp_path / "snaps", tiny_model, lambda: [(5, old), (0, new)], ticks=5)
    with caplog.at_level(logging.INFO, logger="prefix-bundles"):
        assert snaps.tick() == 6
    assert "snapshots: saved 2 entries" in caplog.text
    assert "(periodic, every 0 min; the server waited)" in caplog.text
    snapshots = [p for p in (tmp_path / "snaps" / "set-1").iterdir() if p.is_dir()]
    assert sorted(p.name[:2] for p in snapshots) == ["00", "01"]
    counts = {p.name[:2]: len((p / "cache.safetensors").read_bytes()) for p in snapshots}
    assert counts["00"] < counts["01"]  # rank 00: the 52-token entry being stored, hottest
    # the stop's save: the periodic ones end there
    snaps.save([(1, Entry(TOKENS, cache, "test", False))], lambda ids: 0)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="prefix-bundles"):
        snaps.tick()
    assert "saved" not in caplog.text
    assert sorted(p.name for p in (tmp_path / "snaps").iterdir()) == [".lock", "set-2"]
    snaps.close()


def test_a_failed_periodic_save_keeps_the_previous_set_and_never_raises(
    tmp_path: Path, tiny_model: Path, caplog, monkeypatch: pytest.MonkeyPatch
):
    entries = [
        (1, Entry(TOKENS, prefilled(tiny_model, TOKENS), "test", False)),
        (2, Entry(TOKENS[:40], prefilled(tiny_model, TOKENS[:40]), "test", False)),
    ]
    snaps = periodic(tmp_path / "snaps", tiny_model, lambda: entries)
    snaps.tick()
    set1 = tmp_path / "snaps" / "set-1"
    before = {p.relative_to(set1): p.read_bytes() for p in set1.rglob("*") if p.is_file()}
    written, write = [], snapshot_store.write_snapshot

    def full_disk(parent, rank, entry, context, key):
        if written:  # the second snapshot of the set: the disk is full
            raise OSError(28, "No space left on device")
        written.append(write(parent, rank, entry, context, key))

    monkeypatch.setattr(snapshot_store, "write_snapshot", full_disk)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="prefix-bundles"):
        assert snaps.tick() == 2  # the server's thread goes on
    assert (
        f"snapshots: periodic save failed: the new set was not saved under {set1.parent} "
        "(OSError: [Errno 28] No space left on device: the disk is full or cannot be written); "
        f"the previous set {set1} stays; free space there or lower --snapshot-budget; the next "
        "save is due in 0 min"
    ) in caplog.text
    assert sorted(p.name for p in (tmp_path / "snaps").iterdir()) == [".lock", "set-1"]
    after = {p.relative_to(set1): p.read_bytes() for p in set1.rglob("*") if p.is_file()}
    assert after == before and len(before) == 9 and written  # the failure came mid-set (8 + mark)
    snaps.close()
