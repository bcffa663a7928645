"""--snapshots DIR is held by one serve from the moment it is checked (issue 48, finding 7): where
a spawned model process serves the mount (mlx-openai-server), serve locks DIR and hands that very
lock to the process it spawns, never releasing it in between (pipeline.runtime.snapshots)."""

from __future__ import annotations

import multiprocessing
import signal
import time
from multiprocessing import util
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.format.errors import PipelineError
from pipeline.runtime import snapshots
from pipeline.runtime.snapshot_store import SnapshotFolder
from pipeline.runtime.snapshots import parent_of_snapshots


def model_process(root: str, held: int, told, done) -> None:
    """A spawned model process: DIR under the lock its serve handed down, until told to end."""
    try:
        folder = SnapshotFolder(Path(root), held=held)
    except PipelineError as exc:
        told.put(f"refused: {exc}")
        return
    told.put("holds")
    done.wait(60)
    folder.close()


def in_use(root: Path) -> bool:
    try:
        SnapshotFolder(root).close()
    except PipelineError as exc:
        assert str(exc) == (
            f"--snapshots {root} is in use by another serve process (it holds {root / '.lock'}); "
            "give each serve its own snapshot folder"
        )
        return True
    return False


@pytest.fixture
def parent(monkeypatch: pytest.MonkeyPatch):
    """serve's process state the hand-over changes, restored after the test."""
    monkeypatch.setattr(util, "spawnv_passfds", util.spawnv_passfds)
    monkeypatch.setattr(snapshots, "_HELD", None, raising=False)
    term = signal.getsignal(signal.SIGTERM)
    yield
    if snapshots.__dict__.get("_HELD") is not None:
        snapshots._HELD.close()
    signal.signal(signal.SIGTERM, term)


def test_the_lock_is_handed_to_the_spawned_process_and_never_free_between(tmp_path: Path, parent):
    root = tmp_path / "snaps"
    held = parent_of_snapshots(SimpleNamespace(snapshots=root))
    assert in_use(root)  # from the check on: a second serve started meanwhile is refused
    ctx = multiprocessing.get_context("spawn")
    told, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=model_process, args=(str(root), held, told, done))
    child.start()
    try:
        assert told.get(timeout=60) == "holds"
        snapshots._HELD.close()  # serve gone (killed): the model process still holds DIR
        snapshots._HELD = None
        assert in_use(root)
    finally:
        done.set()
        child.join(60)
    assert child.exitcode == 0 and not in_use(root)


def test_a_lock_that_is_not_this_folders_is_refused(tmp_path: Path):
    (tmp_path / "a").mkdir(mode=0o700)
    (tmp_path / "b").mkdir(mode=0o700)
    other = SnapshotFolder(tmp_path / "a")
    try:
        with pytest.raises(PipelineError) as exc:
            SnapshotFolder(tmp_path / "b", held=other.lock_fd)
        assert str(exc.value) == (
            f"--snapshots {tmp_path / 'b'}: the lock serve took on {tmp_path / 'b' / '.lock'} is "
            "not held by this model process (the folder changed after serve checked it); "
            "restart serve"
        )
    finally:
        other.close()


@pytest.mark.slow
def test_two_serves_of_mlx_openai_server_started_together_on_one_folder(
    tiny_model: Path, tmp_path: Path
):
    """The real server: one serve holds DIR; the other says so in one line and exits 1."""
    import os
    import subprocess

    from servers_env import ROOT, free_port, servers_python, wait_ready

    python = servers_python()
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "c"), "HOME": str(tmp_path / "h")}
    (tmp_path / "bundles").mkdir()
    ports, logs, procs = [free_port(), free_port()], [tmp_path / "a.log", tmp_path / "b.log"], []
    for port, log in zip(ports, logs, strict=True):
        args = [str(python), str(ROOT / "build.py"), "--bundles", str(tmp_path / "bundles")]
        args += ["serve", "--server", "mlx-openai-server", "--model", str(tiny_model)]
        args += ["--port", str(port), "--snapshots", str(tmp_path / "snaps")]
        with open(log, "w") as out:
            procs.append(subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env))
    try:
        codes = [None, None]
        deadline = time.monotonic() + 300
        while None in codes and time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if codes.count(None) == 1 and any(c is not None for c in codes):
                break
            time.sleep(0.5)
        (lost,) = [i for i, c in enumerate(codes) if c is not None]
        won = 1 - lost
        wait_ready(ports[won], procs[won], logs[won])
        text = logs[lost].read_text()
        assert codes[lost] == 1 and "Traceback" not in text, text[-3000:]
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        assert errors == [
            f"error: --snapshots {tmp_path / 'snaps'} is in use by another serve process (it "
            f"holds {tmp_path / 'snaps' / '.lock'}); give each serve its own snapshot folder"
        ], text[-3000:]
        assert "snapshots: none in" in logs[won].read_text()  # its model process holds DIR
        assert "Traceback" not in logs[won].read_text()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(60)
