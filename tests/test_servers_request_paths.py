"""Bundle ids from each server's own request code (pipeline.builder.server_ids,
pipeline.runtime.servers.tokens.request_ids): omni rebuilds tool schemas through its pydantic
request models, dropping `additionalProperties` and `minProperties`, so a bundle built from the
builder's rendering parts from omni's ids inside the tool block. serve says so at startup (and
--strict refuses); a definition with `servers = ["mlx-omni-server"]`, built where omni is
installed, follows omni's ids and is reused whole on omni's first request, with the answer a
cold omni gives."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from servers_env import ROOT, after_warm_up, chat, free_port, running_together, servers_python

from pipeline.format.manifest import Manifest

from conftest import SYSTEM, write_definition

APP = ROOT / "tests" / "envs" / "omni_chat_app.py"
TOOLS = json.loads((ROOT / "prefixes" / "support-agent" / "tools.json").read_text())
assert any("additionalProperties" in json.dumps(t) for t in TOOLS)  # what omni drops


def request(model: Path) -> dict:
    return {
        "model": str(model),
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Where is my order 12345?"},
        ],
        "tools": TOOLS,
        "max_tokens": 8,
        "temperature": 0.0,
    }


def build_in_server_venv(tmp_path: Path, model: Path, name: str, servers: list[str]) -> Path:
    """Build prefixes/<name>.toml (SYSTEM + the demo's tools) with the server venv's python."""
    extra = f"servers = {json.dumps(servers)}" if servers else ""
    write_definition(tmp_path, model, name=name, extra=extra)
    (tmp_path / "prefixes" / name / "tools.json").write_text(json.dumps(TOOLS, indent=2))
    args = [str(servers_python()), str(ROOT / "build.py"), "--prefixes", "prefixes"]
    args += ["--bundles", "bundles", "build", name]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (bundle,) = (tmp_path / "bundles").glob(f"{name}/*/*")
    return bundle


def omni(model: Path, bundles: Path, port: int, *serve: str) -> list[str]:
    args = [str(servers_python()), str(APP), "--bundles", str(bundles), "serve", *serve]
    return [*args, "--server", "mlx-omni-server", "--model", str(model), "--port", str(port)]


def read_log(path: Path) -> str:
    """The log with omni's wrapped lines (rich) joined: whitespace runs as one space."""
    return " ".join(path.read_text().split())


def covered(log: str, name: str) -> list[int]:
    """What the bundle covered for the clients' requests (after serve's warm-up request; omni
    fails a request whose first token ends it, which the random tiny model may give)."""
    assert "mlx-omni-server: warm" in log, log[-3000:]
    clients = after_warm_up(log)
    return [int(n) for n in re.findall(rf"bundle {name}@1 covers (\d+) of \d+ prompt", clients)]


@pytest.mark.slow
def test_omni_reuses_a_bundle_built_through_its_own_request_code_whole(
    tiny_model: Path, tmp_path: Path
):
    plain = build_in_server_venv(tmp_path, tiny_model, "agent", [])
    own = build_in_server_venv(tmp_path, tiny_model, "agent-omni", ["mlx-omni-server"])
    plain_m = Manifest.model_validate_json((plain / "manifest.json").read_text())
    own_m = Manifest.model_validate_json((own / "manifest.json").read_text())
    assert own_m.request.tokenization == ["mlx-omni-server"] and plain_m.request.tokenization == []
    assert json.loads(own_m.request.tools_json) == TOOLS  # the definition's tools, in order
    total = plain_m.tokens.count

    # the builder's rendering: serve names the bundle, the token where omni parts and the fix
    only_plain, only_own, empty = tmp_path / "only-plain", tmp_path / "only-own", tmp_path / "none"
    shutil.copytree(plain.parents[1], only_plain / "agent")
    shutil.copytree(own.parents[1], only_own / "agent-omni")
    empty.mkdir()
    ports = {"plain": free_port(), "own": free_port(), "cold": free_port()}
    folders = {"plain": only_plain, "own": only_own, "cold": empty}
    servers = [
        (omni(tiny_model, folders[k], p), p, tmp_path / f"{k}.log") for k, p in ports.items()
    ]
    with running_together(servers):  # side by side: each start is mostly one core's imports
        chat(ports["plain"], request(tiny_model))
        warm, _ = chat(ports["own"], request(tiny_model))
        cold, _ = chat(ports["cold"], request(tiny_model))
    log = read_log(tmp_path / "plain.log")
    warned = re.search(
        rf"agent@1: requests will reuse at most (\d+) of its {total} tokens: mlx-omni-server's "
        r"own request code parts from the bundle at token (\d+) .*add \"mlx-omni-server\" to the "
        r"definition's servers and rebuild",
        log,
    )
    assert warned, log[-3000:]
    parted = int(warned.group(1))
    assert parted < total * 0.99 and covered(log, "agent") == [parted]

    # --strict refuses it before omni starts
    proc = subprocess.run(
        omni(tiny_model, only_plain, free_port(), "--strict"),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode != 0 and "--strict: bundle" in proc.stderr
    assert f"requests will reuse at most {parted} of its {total}" in " ".join(proc.stderr.split())

    # built through omni's own request code: no warning, the whole bundle on the first request
    log = read_log(tmp_path / "own.log")
    assert "requests will reuse at most" not in log
    assert covered(log, "agent-omni") == [own_m.tokens.count]

    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
