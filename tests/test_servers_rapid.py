"""`serve --server rapid-mlx`: rapid-mlx 0.16.10 (a vllm-mlx fork whose BatchedEngine is its only
engine; its own venv: tests/envs/make_rapid_env.sh) as a real server process over loopback HTTP on
this Linux CPU, the bundles pinned in its scheduler's MemoryAwarePrefixCache."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from servers_env import ROOT, body, chat, free_port, rapid_python, running_together

from pipeline.format.manifest import Manifest

from conftest import claude_code_request

QUESTIONS = [f"Where is my order {n}?" for n in (12345, 777, 4242, 9, 31337, 2026, 55, 808)]


def rapid(model: Path, bundles: Path, port: int, *extra: str) -> list[str]:
    serve = [str(rapid_python()), str(ROOT / "build.py"), "--bundles", str(bundles), "serve"]
    return [*serve, "--server", "rapid-mlx", "--model", str(model), "--port", str(port), *extra]


def post(port: int, route: str, data: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{route}",
        data=json.dumps(data).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


# its prefix caches under serve: the memory-aware one (its default) and the paged one
ENGINES = pytest.mark.parametrize("cache", [(), ("--use-paged-cache",)], ids=["memory", "paged"])


@pytest.mark.slow
@ENGINES
def test_rapid_mlx_reuses_the_pinned_bundle_and_answers_as_cold(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path, cache: tuple[str, ...]
):
    count = Manifest.model_validate_json((shop_bundle / "manifest.json").read_text()).tokens.count
    home = tmp_path / "home"  # rapid-mlx's own disk cache: ~/.cache/rapid-mlx/prefix_cache
    stale = home / ".cache" / "rapid-mlx" / "prefix_cache" / "stale"
    stale.mkdir(parents=True)
    (stale / "index.json").write_text(json.dumps({"version": 1, "entries": [{"file": "x"}]}))
    env = {"HOME": str(home)}
    port, cold_port, empty = free_port(), free_port(), tmp_path / "none"
    empty.mkdir()
    warm_server = (
        rapid(tiny_model, shop_bundle.parents[2], port, *cache),
        port,
        tmp_path / "w.log",
    )
    cold_server = (rapid(tiny_model, empty, cold_port, *cache), cold_port, tmp_path / "c.log")
    with running_together([warm_server, cold_server], env):
        cold = [chat(cold_port, body(tiny_model, q))[0] for q in QUESTIONS]
        with ThreadPoolExecutor(8) as pool:  # 8 at once on the fresh bundle
            together = list(pool.map(lambda q: chat(port, body(tiny_model, q))[0], QUESTIONS))
        one_by_one = [chat(port, body(tiny_model, q))[0] for q in QUESTIONS]
        status, anthropic = post(port, "/v1/messages", claude_code_request(str(tiny_model)))
        refused, answer = post(port, "/v1/cache/import", {"path": str(tmp_path)})
    log = (tmp_path / "w.log").read_text()
    assert "1 bundle(s) mounted, 0 refused" in log and "Traceback" not in log
    assert "its own on-disk prefix cache is neither restored nor saved under serve" in log
    # its own app (route, converter, engine) computed the bundle's ids at the warm-up
    assert "rapid-mlx: its own app computed the ids of 1 of 1 recorded bundle(s) exactly" in log
    served = [int(n) for n in re.findall(r"bundle shop@1 covers (\d+) of \d+ prompt", log)]
    assert served[: len(QUESTIONS)] == [count] * len(QUESTIONS)
    assert [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in together] == [
        count
    ] * len(QUESTIONS)
    assert [r["choices"][0]["message"] for r in together] == [
        r["choices"][0]["message"] for r in one_by_one
    ]
    assert status == 200 and anthropic["content"]
    assert refused == 403 and "refused under serve" in answer["error"]["message"]
    assert sorted(p.name for p in stale.parent.iterdir()) == ["stale"]  # nothing written
    assert [r["choices"][0]["message"] for r in cold] == [
        r["choices"][0]["message"] for r in one_by_one
    ]
