"""GET /v1/models under serve on a host with no hub cache folder (a fresh machine): every server
serve wraps answers with a JSON list, and those that list a local model folder list the served
one (mlx_lm.server scanned the hub cache first and sent an empty 200 body with a CacheNotFound
traceback in its log)."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest
from servers_env import ROOT, free_port, running, servers_python

OMNI_APP = ROOT / "tests" / "envs" / "omni_chat_app.py"


def command(server: str, model: Path, bundles: Path, port: int) -> list[str]:
    serve = ["--bundles", str(bundles), "serve", "--server", server, "--model", str(model)]
    if server == "mlx-lm":
        return [sys.executable, str(ROOT / "build.py"), *serve, "--port", str(port)]
    if server == "mlx-omni-server":
        return [str(servers_python()), str(OMNI_APP), *serve, "--port", str(port)]
    return [str(servers_python()), str(ROOT / "build.py"), *serve, "--port", str(port)]


@pytest.mark.slow
@pytest.mark.parametrize("server", ["mlx-lm", "vllm-mlx", "mlx-openai-server", "mlx-omni-server"])
def test_models_route_answers_with_no_hub_cache(
    server: str, shop_bundle: Path, tiny_model: Path, tmp_path: Path
):
    missing = tmp_path / "no-hub-cache"  # never created
    env = {"HF_HOME": str(missing), "HF_HUB_CACHE": str(missing / "hub"), "HF_HUB_OFFLINE": "1"}
    port = free_port()
    args = command(server, tiny_model, shop_bundle.parents[2], port)
    with running(args, port, tmp_path / "server.log", env):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=60) as resp:
            listing = json.loads(resp.read())
    assert resp.status == 200 and isinstance(listing["data"], list)
    ids = {m["id"] for m in listing["data"]}
    if server != "mlx-omni-server":  # omni lists hub-cache models only (its own design)
        assert any(Path(i).resolve() == tiny_model.resolve() for i in ids if "/" in i) or (
            tiny_model.name in ids or str(tiny_model) in ids
        ), ids
    assert "Traceback" not in (tmp_path / "server.log").read_text()
