"""serve --snapshots: the server's entries spilled to DIR while it serves (snapshot_spill), on
every server: captured where the hook stores (copy-on-write views), written by a thread of their
own once the server is quiet (or a change has waited --snapshot-every), atomically: a full disk
keeps the previous set and never reaches the server. The real servers, killed with SIGKILL:
tests/test_servers_snapshots_crash.py (slow)."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_snapshots import TOKENS, host, prefilled  # noqa: F401 - host: the fixture used below

from pipeline.format.errors import PipelineError
from pipeline.runtime.servers import hook_for
from pipeline.runtime.servers.options import every_seconds
from pipeline.runtime.snapshot_spill import DEFAULT_EVERY_S, QUIET_S
from pipeline.runtime.snapshot_store import Entry
from pipeline.runtime.snapshots import DEFAULT_BUDGET, Snapshots

pytestmark = pytest.mark.usefixtures("host")  # a host key folder of each test's own
SERVERS = ("mlx-lm", "vllm-mlx", "rapid-mlx", "mlx-omni-server", "mlx-openai-server")
EVERY = [
    *[(None, s, Path("s"), DEFAULT_EVERY_S) for s in SERVERS],  # on by default, every server
    ("5", "vllm-mlx", Path("s"), 300.0),
    ("0.5", "mlx-openai-server", Path("s"), 30.0),
    ("0", "rapid-mlx", Path("s"), 0.0),  # no spill: saved at a graceful stop only
    ("off", "mlx-lm", Path("s"), 0.0),
    (None, "mlx-lm", None, None),  # no --snapshots: nothing
    ("5", "mlx-lm", None, "--snapshot-every needs --snapshots DIR (the folder it spills to)"),
    ("-1", "mlx-lm", Path("s"), "--snapshot-every '-1' is not a number of minutes; pass a number "
     "of 0 or more (e.g. 5, or 0.5 for 30 seconds; 0 or off: no spill while serving)"),
    ("soon", "mlx-lm", Path("s"), "--snapshot-every 'soon' is not a number of minutes"),
]  # fmt: skip


@pytest.mark.parametrize("text, server, folder, expected", EVERY)
def test_snapshot_every_is_checked_before_anything_loads(text, server, folder, expected):
    options = SimpleNamespace(snapshot_every=text, snapshots=folder)
    if not isinstance(expected, str):
        assert every_seconds(options, hook_for(server)) == expected
        return
    with pytest.raises(PipelineError) as exc:
        every_seconds(options, hook_for(server))
    assert str(exc.value).startswith(expected)


def spilling(root: Path, model: Path, listing) -> Snapshots:
    """Snapshots spilling `listing()` at every step (`spiller.spill()`), no thread of its own."""
    snaps = Snapshots(root, DEFAULT_BUDGET, model, None, "mlx-lm")
    snaps.spill_while_serving(0.0, listing, lambda ids: 0, start=False)
    return snaps


def set_files(folder: Path) -> dict[Path, bytes]:
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_capture_is_what_is_spilled_whatever_the_server_does_after(
    tmp_path: Path, tiny_model: Path, caplog
):
    import mlx.core as mx

    cache = prefilled(tiny_model, TOKENS)
    snaps = spilling(
        tmp_path / "snaps", tiny_model, lambda: [(1, Entry(TOKENS, cache, "t", False))]
    )
    snaps.changed()  # on the server's thread, right after it stored the entry
    before = [mx.array(layer.keys[..., : layer.offset, :]) for layer in cache]
    for layer in cache:  # the server writes into its entry in place after the capture
        layer.keys[..., :4, :] = 0.0
    with caplog.at_level(logging.INFO, logger="prefix-bundles"):
        assert snaps.spiller.spill()
    assert "snapshots: saved 1 entry (300 tokens" in caplog.text
    assert "(spilled while serving, 1 captures, capture " in caplog.text
    assert not snaps.spiller.spill()  # nothing new: nothing written
    snaps.changed()  # stored again, the same entries (a hit re-stamped one): not written again
    assert not snaps.spiller.spill()
    assert sorted(p.name for p in (tmp_path / "snaps").iterdir()) == [".lock", "set-1"]
    snaps.close()
    again = Snapshots(tmp_path / "snaps", DEFAULT_BUDGET, tiny_model, None, "mlx-lm")
    again.restore([])
    (restored,) = again._shelf  # each layer's keys as captured, not as the server changed them
    assert all(
        mx.array_equal(r.keys, b).item() for r, b in zip(restored.cache, before, strict=True)
    )
    again.close()


def test_a_spill_waits_for_quiet_or_every_and_the_stop_ends_them(tmp_path: Path, tiny_model: Path):
    entry = Entry(TOKENS, prefilled(tiny_model, TOKENS), "t", False)
    snaps = Snapshots(tmp_path / "snaps", DEFAULT_BUDGET, tiny_model, None, "mlx-lm")
    spiller = snaps.spill_while_serving(60.0, lambda: [(1, entry)], lambda ids: 0, start=False)
    assert spiller.due_in(0.0) is None  # nothing stored yet
    snaps.changed()
    stored = spiller._last_change
    assert spiller.due_in(stored) == pytest.approx(QUIET_S)  # the first: once quiet
    assert spiller.due_in(stored + QUIET_S) == 0
    assert spiller.spill()
    snaps.changed()  # stored again right after: not sooner than --snapshot-every after it
    assert spiller.due_in(spiller._last_change + QUIET_S) == pytest.approx(60.0, abs=QUIET_S + 1)
    snaps.save([(1, entry)], lambda ids: 0)  # the graceful stop's save
    snaps.changed()
    assert not spiller.spill()  # no spill after the stop's save began
    assert sorted(p.name for p in (tmp_path / "snaps").iterdir()) == [".lock", "set-2"]
    snaps.close()


def test_the_spill_thread_spills_once_the_server_is_quiet(tmp_path: Path, tiny_model: Path):
    import time

    entry = Entry(TOKENS, prefilled(tiny_model, TOKENS), "t", False)
    snaps = Snapshots(tmp_path / "snaps", DEFAULT_BUDGET, tiny_model, None, "mlx-lm")
    spiller = snaps.spill_while_serving(0.0, lambda: [(1, entry)], lambda ids: 0)
    snaps.changed()
    deadline = time.monotonic() + QUIET_S + 30
    while spiller.spills == 0:  # the thread's own clock: once QUIET_S has passed
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert (tmp_path / "snaps" / "set-1").is_dir()
    snaps.stop_saving()
    snaps.close()


@contextlib.contextmanager
def tmpfs(where: Path, size: str):
    """A real filesystem of `size` at `where` (root only: skipped elsewhere)."""
    where.mkdir(mode=0o700)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a full disk) needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "none", str(where)], capture_output=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_keeps_the_previous_set_and_never_reaches_the_server(
    tmp_path: Path, tiny_model: Path, caplog
):
    """A 2 MiB tmpfs: the first set (one 300-token entry) fits, the second (a longer one, written
    beside the first until it is complete) does not."""
    small = Entry(TOKENS, prefilled(tiny_model, TOKENS), "t", False)
    longer = [*TOKENS, *TOKENS, *TOKENS]
    big = Entry(longer, prefilled(tiny_model, longer), "t", False)
    listed = [[(1, small)]]
    with tmpfs(tmp_path / "full", "2m") as root:
        snaps = spilling(root / "snaps", tiny_model, lambda: listed[0])
        snaps.changed()
        assert snaps.spiller.spill()
        set1 = root / "snaps" / "set-1"
        before = set_files(set1)
        listed[0] = [(2, big)]
        snaps.changed()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="prefix-bundles"):
            assert not snaps.spiller.spill()  # one line; the spill thread goes on
        (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert line.startswith(
            f"snapshots: spill failed: the new set was not saved under {set1.parent} ("
        )
        assert line.endswith(
            f"the disk is full or cannot be written); the previous set {set1} stays; free space "
            "there or lower --snapshot-budget; the next spill is tried after the next new entry, "
            "0 s from now at the earliest"
        )
        assert sorted(p.name for p in set1.parent.iterdir()) == [".lock", "set-1"]  # no staging
        assert set_files(set1) == before
        snaps.close()
        # the next start mounts the previous set whole
        again = Snapshots(root / "snaps", DEFAULT_BUDGET, tiny_model, None, "mlx-lm")
        with caplog.at_level(logging.INFO, logger="prefix-bundles"):
            again.restore([])
        assert len(again) == 1 and f"restored 1 of 1 from {set1}" in caplog.text
        again.close()
