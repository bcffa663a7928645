"""The server venv (tests/envs/make_servers_env.sh) and real server processes over loopback HTTP,
for tests/test_servers_*.py."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("PREFIX_BUNDLES_SERVERS_VENV", ROOT / ".venv-servers"))
MAKE = "tests/envs/make_servers_env.sh"
RAPID_VENV = Path(os.environ.get("PREFIX_BUNDLES_RAPID_VENV", ROOT / ".venv-rapid"))
QUESTION = "Where is my order 12345?"


def body(model: Path | str, question: str = QUESTION) -> dict:
    """A chat request at temperature 0 on the shop prefix (conftest's SYSTEM and TOOLS)."""
    from conftest import SYSTEM, TOOLS

    return {
        "model": str(model),
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ],
        "tools": TOOLS,
        "max_tokens": 12,
        "temperature": 0.0,
    }


def servers_python() -> Path:
    """The server venv's python; skips when it is absent, except in CI (CI=true), where it fails."""
    return venv_python(VENV, MAKE)


def rapid_python() -> Path:
    """rapid-mlx's venv's python (tests/envs/make_rapid_env.sh), skipped or failed as above."""
    return venv_python(RAPID_VENV, "tests/envs/make_rapid_env.sh")


def venv_python(venv: Path, make: str) -> Path:
    python = venv / "bin" / "python"
    if python.exists():
        return python
    why = f"no venv at {venv}: run {make} (.ci/run does)"
    if os.environ.get("CI") == "true":
        pytest.fail(why)
    pytest.skip(why)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {log.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"server not ready after {timeout} s: {log.read_text()}")


@contextmanager
def running(
    args: list[str], port: int, log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """Start a server command line (with `env` added to the environment), wait until /health
    answers, stop it (by its pid) after."""
    with running_together([(args, port, log)], env) as (proc,):
        yield proc


@contextmanager
def running_together(
    servers: list[tuple[list[str], int, Path]], env: dict[str, str] | None = None
) -> Iterator[list[subprocess.Popen]]:
    """`running` for several (command line, port, log) at once: all start before any is waited
    for (a warm and a cold server start side by side: each start is mostly one core's imports)."""
    environ = {**os.environ, **(env or {})}
    procs: list[subprocess.Popen] = []
    try:
        for args, _, log in servers:
            with open(log, "w") as out:
                procs.append(
                    subprocess.Popen(
                        args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=environ
                    )
                )
        for proc, (_, port, log) in zip(procs, servers, strict=True):
            wait_ready(port, proc, log)
        yield procs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def chat(port: int, body: dict, timeout: float = 600) -> tuple[dict, float]:
    """One chat completion and its wall time in seconds."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read()), time.perf_counter() - start


def stream(port: int, route: str, body: dict, timeout: float = 600) -> list[dict]:
    """The JSON data of each server-sent event of a streamed request, in order."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{route}",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        lines = resp.read().decode().splitlines()
    data = [line[6:] for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    return [json.loads(d) for d in data]


# serve's warm-up line on every server (omni's rich log may wrap it: any whitespace between words)
WARM_UP_LINE = re.compile(
    r"warmed\s+up\s+its\s+generation\s+path|warm-up\s+failed|warmed\s+up\s+from"
)


def after_warm_up(log: str) -> str:
    """The log after serve's warm-up (its own lookup is no client's): what clients' requests did.
    The whole log when no warm-up ran."""
    return WARM_UP_LINE.split(log)[-1]
