"""serve's logged "try" request is served from the mounted bundle (issue 50, finding 4: its curl
sent "Hello" and answered cached_tokens 1): the command the line logs, run as logged against the
real served tiny model, reuses the tokens the line says, and more than one."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import urllib.request
from pathlib import Path

import pytest
from test_serve import server_process

ROOT = Path(__file__).resolve().parents[1]


def logged_try(log: str) -> tuple[str, bytes, int]:
    """(url, body, tokens said to come from the bundle) of the try line: its command's first half
    run (it prints the body), its curl's URL (curl itself may be absent: urllib sends it)."""
    line = next(text for text in log.splitlines() if "once the port opens, try" in text)
    said = re.search(r"\(([\d,]+) of its [\d,]+ tokens come from the bundle", line)
    assert said is not None, line
    printer, curl = line[line.index("): ") + 3 :].split(" | ")
    curl = shlex.split(curl)
    assert curl[:2] == ["curl", "-s"] and curl[-2:] == ["-d", "@-"], curl
    env, *printer = shlex.split(printer)  # PYTHONPATH=...: where serve's pipeline imports from
    name, value = env.split("=", 1)
    assert name == "PYTHONPATH", env
    run = {
        "capture_output": True,
        "check": True,
        "timeout": 120,
        "env": {**os.environ, name: value},
    }
    body = subprocess.run(printer, **run)
    return curl[2], body.stdout, int(said[1].replace(",", ""))


def post(url: str, body: bytes) -> dict:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as resp:
        return json.loads(resp.read())


def test_the_logged_try_request_is_served_from_the_mounted_bundle(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path
):
    log = tmp_path / "serve.log"
    with server_process(tiny_model, shop_bundle.parents[2], log) as (_, port):
        url, body, said = logged_try(log.read_text())
        assert url == f"http://127.0.0.1:{port}/v1/chat/completions"
        answer = post(url, body)
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 1 and cached == said, (cached, said)


def test_the_body_printer_says_one_line_on_a_folder_that_is_no_bundle(tmp_path: Path):
    import sys

    printer = [sys.executable, "-m", "pipeline.runtime.servers.try_request"]
    root = str(Path(__file__).resolve().parents[1])
    run = {"capture_output": True, "text": True, "env": {**os.environ, "PYTHONPATH": root}}
    proc = subprocess.run([*printer, str(tmp_path), "m"], **run)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    proc = subprocess.run(printer, **run)
    assert proc.returncode == 2 and proc.stderr.startswith("usage: "), proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "server", ["vllm-mlx", "rapid-mlx", "mlx-omni-server", "mlx-openai-server"]
)
def test_every_server_logs_a_try_request_its_bundle_serves(
    server: str, shop_bundle: Path, tiny_model: Path, tmp_path: Path
):
    """The same on each other server, in its venv: the count is this server's own (omni's request
    code parts from the builder's rendering earlier than the others'), and mlx-openai-server's
    serve process, which unpins the bundles for its model process, still counts them."""
    from servers_env import free_port, rapid_python, running, servers_python

    python = rapid_python() if server == "rapid-mlx" else servers_python()
    # omni's full app needs mflux: its chat route behind serve stands in (as in its other tests)
    entry = ROOT / "tests" / "envs" / ("omni_chat_app.py" if server == "mlx-omni-server" else "")
    entry = entry if server == "mlx-omni-server" else ROOT / "build.py"
    port, log = free_port(), tmp_path / "serve.log"
    args = [str(python), str(entry), "--bundles", str(shop_bundle.parents[2]), "serve"]
    args += ["--server", server, "--model", str(tiny_model), "--port", str(port)]
    # a fresh HOME (vllm-mlx and rapid-mlx keep prefix caches there); omni logs through rich,
    # which wraps lines at the terminal's width
    with running(args, port, log, {"HOME": str(tmp_path), "COLUMNS": "100000"}):
        url, body, said = logged_try(log.read_text())
        answer = post(url, body)
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 1 and cached == said, (cached, said)
