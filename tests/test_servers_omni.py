"""`serve --server mlx-omni-server`: omni 0.5.3's own chat route (OpenAI router -> ChatGenerator ->
PromptCachePool) over loopback HTTP in the server venv, prepared by serve's own code
(tests/envs/omni_chat_app.py; omni's full app needs mflux, which does not install on Linux)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from servers_env import ROOT, after_warm_up, body, chat, free_port, running_together, servers_python

from pipeline.format.manifest import Manifest

APP = ROOT / "tests" / "envs" / "omni_chat_app.py"


def omni(python: Path, model: Path, bundles: Path, port: int) -> list[str]:
    serve = ["--bundles", str(bundles), "serve", "--server", "mlx-omni-server"]
    return [str(python), str(APP), *serve, "--model", str(model), "--port", str(port)]


@pytest.mark.slow
def test_requests_naming_the_model_folder_reuse_the_pinned_bundle(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path
):
    python = servers_python()
    tokens = Manifest.model_validate_json((shop_bundle / "manifest.json").read_text()).tokens
    port, cold_port, empty = free_port(), free_port(), tmp_path / "none"
    empty.mkdir()
    warm_server = (omni(python, tiny_model, shop_bundle.parents[2], port), port, tmp_path / "w.log")
    cold_server = (omni(python, tiny_model, empty, cold_port), cold_port, tmp_path / "c.log")
    with running_together([warm_server, cold_server]):
        warm, _ = chat(port, body(str(tiny_model), "Where is my order 12345?"))
        other, _ = chat(port, body(str(tiny_model), "And my order 777?"))
        cold, _ = chat(cold_port, body(str(tiny_model), "Where is my order 12345?"))
        cold_other, _ = chat(cold_port, body(str(tiny_model), "And my order 777?"))
    log = (tmp_path / "w.log").read_text()
    assert "mounted shop@1" in log and "1 bundle(s) mounted, 0 refused" in log
    assert "mlx-omni-server: requests will reuse" not in log  # no BOS: omni sees the bundle's ids
    clients = after_warm_up(log)
    covered = re.findall(r"bundle shop@1 covers (\d+) of \d+ prompt tokens", clients)
    # the first request from the bundle; the second from omni's own pool entry when it covers more
    assert int(covered[0]) == tokens.count
    assert "no bundle covers" in (tmp_path / "c.log").read_text()
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    assert other["choices"][0]["message"] == cold_other["choices"][0]["message"]
