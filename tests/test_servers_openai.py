"""`serve --server mlx-openai-server`: the real mlx-openai-server 1.8.1 (in the server venv) over
loopback HTTP; the bundle is validated in the parent and mounted in the spawned handler process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from servers_env import ROOT, after_warm_up, body, chat, free_port, running_together, servers_python

from pipeline.format.manifest import Manifest


def serve(python: Path, model: Path, bundles: Path, port: int, *extra: str) -> list[str]:
    args = [str(python), str(ROOT / "build.py"), "--bundles", str(bundles), "serve", *extra]
    return [*args, "--server", "mlx-openai-server", "--model", str(model), "--port", str(port)]


@pytest.mark.slow
def test_the_spawned_handler_reuses_the_bundle_and_answers_as_a_cold_server(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path
):
    python = servers_python()
    count = Manifest.model_validate_json((shop_bundle / "manifest.json").read_text()).tokens.count
    port, cold_port, empty = free_port(), free_port(), tmp_path / "none"
    empty.mkdir()
    args = serve(python, tiny_model, shop_bundle.parents[2], port, "--warm-up")  # default: off
    cold_args = serve(python, tiny_model, empty, cold_port)
    with running_together(
        [(args, port, tmp_path / "w.log"), (cold_args, cold_port, tmp_path / "c.log")]
    ):
        warm, _ = chat(port, body(tiny_model, "Where is my order 12345?"))
        cold, _ = chat(cold_port, body(tiny_model, "Where is my order 12345?"))
    log = (tmp_path / "w.log").read_text()
    pinned = re.search(r"mlx-openai-server: 1 bundle\(s\) pinned in the handler process (\d+)", log)
    assert pinned is not None, log
    assert "mlx-openai-server: warmed up its generation path with shop@1's request" in log
    assert f"bundle shop@1 covers {count} of " in after_warm_up(log)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == count
    assert "no bundle covers" in (tmp_path / "c.log").read_text()
    assert cold["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
