"""`serve --snapshots DIR` keeps what a server learned through a crash, on every server serve
wraps: its entries are spilled to DIR while it serves (no option but --snapshots), `kill -9` of
serve's whole process group (no stop, no save), a restart with the same DIR, and the next turn
reuses the spilled conversation, with the same answer as a server that was not killed. Faults: a
kill in the middle of a spill (the next start mounts the previous set or the new one, never a
half), a second serve on the same folder (refused at its start; the first goes on spilling):
on rapid-mlx, whose --snapshot-every serve refused before spills.
Real server processes in their venvs over loopback HTTP, the tiny test model (its 3.8k-token
conversation: tests/test_snapshots.py's `turn`). The full disk while spilling: a real tmpfs in
tests/test_snapshots_spill.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import servers_env
from servers_env import ROOT, free_port, running, wait_ready
from test_servers_snapshots import SERVERS, serve
from test_snapshots import turn

SETUPS = ["mlx-lm", *SERVERS]  # mlx_lm.server runs in this environment


def command(name: str, model: Path, bundles: Path, port: int, *extra: str) -> list[str]:
    if name != "mlx-lm":
        return serve(name, model, bundles, port, *extra)
    head = [sys.executable, str(ROOT / "build.py"), "--bundles", str(bundles), "serve"]
    return [*head, "--model", str(model), "--port", str(port), *extra]


@contextmanager
def group(args: list[str], port: int, log: Path, env: dict) -> Iterator[subprocess.Popen]:
    """A server in a process group of its own (what `kill -9` of a service's group ends), once
    /health answers; killed with the whole group after, if still there."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **env},
            start_new_session=True,
        )  # fmt: skip
    try:
        wait_ready(port, proc, log)
        yield proc
    finally:
        kill_group(proc)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to serve and every process it started (mlx-openai-server's model process too)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def spilled(root: Path) -> dict[str, int]:
    """{snapshot folder: its token count} of the newest set in DIR (from each manifest.json)."""
    sets = sorted(
        (p for p in root.glob("set-*") if p.is_dir()), key=lambda p: int(p.name.split("-")[1])
    )
    out = {}
    for folder in sets[-1].iterdir() if sets else ():
        try:
            out[folder.name] = json.loads((folder / "manifest.json").read_text())["tokens"]["count"]
        except (OSError, ValueError, KeyError):
            continue  # a set being removed by the next spill
    return out


def wait_spilled(root: Path, tokens: int, log: Path, timeout: float = 120) -> int:
    """Until DIR's newest set holds a snapshot of at least `tokens` tokens; its token count."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts = spilled(root)
        if counts and max(counts.values()) >= tokens:
            return max(counts.values())
        time.sleep(0.1)
    raise AssertionError(f"no spill of {tokens}+ tokens in {root}: {log.read_text()[-4000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("name", SETUPS)
def test_a_conversation_survives_kill_9(name: str, tiny_model: Path, tmp_path: Path):
    env = {"XDG_CONFIG_HOME": str(tmp_path / "config"), "HOME": str(tmp_path / "home")}
    bundles, snaps = tmp_path / "bundles", tmp_path / "snaps"
    bundles.mkdir()
    logs = {k: tmp_path / f"{k}.log" for k in ("ref", "one", "two")}
    ref_port, port = free_port(), free_port()
    with running(command(name, tiny_model, bundles, ref_port), ref_port, logs["ref"], env):
        args = command(name, tiny_model, bundles, port, "--snapshots", str(snaps))
        with group(args, port, logs["one"], env) as one:
            first = turn(port, model=tiny_model)
            answer = first["choices"][0]["message"]["content"]
            assert turn(ref_port, model=tiny_model)["choices"][0]["message"]["content"] == answer
            reference = turn(ref_port, answer, tiny_model)
            prompt = first["usage"]["prompt_tokens"]
            # what a spill holds of the conversation: the prompt (the system prompt alone on
            # vllm-mlx's SimpleEngine, which keeps no other entry by default)
            kept = wait_spilled(snaps, int(0.95 * prompt), logs["one"])
            started = time.monotonic()
            kill_group(one)  # kill -9: no stop, no save
    assert one.returncode == -signal.SIGKILL
    port = free_port()
    args = command(name, tiny_model, bundles, port, "--snapshots", str(snaps))
    with group(args, port, logs["two"], env):
        second = turn(port, answer, tiny_model)
    print(f"{name}: restarted in {time.monotonic() - started:.1f} s")
    one_log, two_log = logs["one"].read_text(), logs["two"].read_text()
    assert "spilled while serving" in one_log, one_log[-3000:]
    assert "snapshots: restored" in two_log and " 0 refused" in two_log, two_log[-3000:]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    expected = reference["usage"]["prompt_tokens_details"]["cached_tokens"]
    print(f"{name}: spilled {kept} tokens of a {prompt}-token prompt; after kill -9 the next "
          f"turn reused {cached} of {second['usage']['prompt_tokens']} (not killed: {expected})")  # fmt: skip
    assert cached >= 0.9 * kept, (name, cached, kept)
    assert second["choices"][0]["message"] == reference["choices"][0]["message"], name
    assert "Traceback" not in one_log + two_log, name


@pytest.mark.slow
def test_a_kill_mid_spill_leaves_a_whole_set_and_a_second_serve_is_refused(
    tiny_model: Path, tmp_path: Path
):
    """rapid-mlx spilling as often as it may (--snapshot-every 0.001): once a spill's staging
    folder appears, kill -9; the next start mounts a whole set (the previous or the new one)."""
    name = "rapid-mlx"
    env = {"XDG_CONFIG_HOME": str(tmp_path / "config"), "HOME": str(tmp_path / "home")}
    bundles, snaps = tmp_path / "bundles", tmp_path / "snaps"
    bundles.mkdir()
    logs = {k: tmp_path / f"{k}.log" for k in ("ref", "one", "two")}
    ref_port, port = free_port(), free_port()
    every = ("--snapshots", str(snaps), "--snapshot-every", "0.001")
    with running(command(name, tiny_model, bundles, ref_port), ref_port, logs["ref"], env):
        with group(command(name, tiny_model, bundles, port, *every), port, logs["one"], env) as one:
            # a second serve on the folder: refused at its start with one line; the first goes on
            other = subprocess.run(
                command(name, tiny_model, bundles, free_port(), *every),
                capture_output=True, text=True, env={**os.environ, **env}, timeout=300,
            )  # fmt: skip
            first = turn(port, model=tiny_model)
            answer = first["choices"][0]["message"]["content"]
            reference = turn(ref_port, answer, tiny_model)
            wait_spilled(snaps, first["usage"]["prompt_tokens"], logs["one"])
            caught = None
            for _ in range(8):  # a turn, then the spill it causes (2 s later): kill inside it
                again = turn(port, answer, tiny_model)
                assert again["choices"][0]["message"] == reference["choices"][0]["message"]
                caught = catch_staging(snaps, timeout=10)
                if caught is not None:
                    kill_group(one)
                    break
            assert caught is not None, logs["one"].read_text()[-3000:]
        before = sorted(p.name for p in snaps.iterdir())
        port = free_port()
        args = command(name, tiny_model, bundles, port, "--snapshots", str(snaps))
        with group(args, port, logs["two"], env):
            second = turn(port, answer, tiny_model)
    assert other.returncode == 1, other.stderr[-2000:]
    assert other.stderr.strip().splitlines()[-1] == (
        f"error: --snapshots {snaps} is in use by another serve process (it holds "
        f"{snaps / '.lock'}); give each serve its own snapshot folder"
    )
    assert any(n.startswith(".staging-") for n in before), before  # killed mid-spill
    two_log = logs["two"].read_text()
    restored = re.search(r"snapshots: restored (\d+) of (\d+) from (\S+) .* (\d+) refused", two_log)
    assert restored is not None, two_log[-3000:]
    assert restored[1] == restored[2] and restored[4] == "0"  # a whole set, nothing refused
    assert Path(restored[3]).name in before
    assert not any(p.name.startswith(".staging-") for p in snaps.iterdir())  # tidied at the start
    assert second["choices"][0]["message"] == reference["choices"][0]["message"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 0.9 * first["usage"]["prompt_tokens"], cached


def catch_staging(root: Path, timeout: float) -> str | None:
    """The name of a spill's staging folder in DIR as soon as one exists (None: none came)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in os.scandir(root):
            if entry.name.startswith(".staging-"):
                return entry.name
        time.sleep(0.0005)
    return None


_ = servers_env  # the venvs: skipped where absent (CI fails instead)
