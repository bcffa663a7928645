"""`serve --server vllm-mlx --continuous-batching`: vllm-mlx 0.6.0's BatchedEngine (its scheduler's
MemoryAwarePrefixCache, mlx-lm's BatchGenerator) with the bundles pinned, a real server process in
the server venv over loopback HTTP."""

from __future__ import annotations

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from servers_env import ROOT, body, chat, free_port, running, servers_python

from pipeline.format.manifest import Manifest

QUESTIONS = [f"Where is my order {n}?" for n in (12345, 777, 4242, 9, 31337, 2026, 55, 808)]


def batching(model: Path, bundles: Path, port: int, *extra: str) -> list[str]:
    serve = [str(servers_python()), str(ROOT / "build.py"), "--bundles", str(bundles), "serve"]
    args = ["--server", "vllm-mlx", "--model", str(model), "--port", str(port)]
    return [*serve, *args, "--continuous-batching", *extra]


def covered(log: str) -> list[int]:
    return [int(n) for n in re.findall(r"bundle shop@1 covers (\d+) of \d+ prompt tokens", log)]


# its prefix caches under serve: the memory-aware one (its default) and the paged one
ENGINES = pytest.mark.parametrize("cache", [(), ("--use-paged-cache",)], ids=["memory", "paged"])


@pytest.mark.slow
@ENGINES
def test_batched_requests_reuse_the_pinned_bundle_and_answer_as_a_cold_server(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path, cache: tuple[str, ...]
):
    count = Manifest.model_validate_json((shop_bundle / "manifest.json").read_text()).tokens.count
    bundles = tmp_path / "bundles"
    shutil.copytree(shop_bundle.parents[2], bundles)
    shutil.copytree(shop_bundle, bundles / "other" / "1" / shop_bundle.name)  # misplaced: refused
    # a stale entry in vllm-mlx's own disk cache (~/.cache/vllm-mlx/prefix_cache/...)
    home = tmp_path / "home"
    own = home / ".cache" / "vllm-mlx" / "prefix_cache" / "stale"
    own.mkdir(parents=True)
    (own / "index.json").write_text(json.dumps({"version": 4, "entries": [{"file": "0.npz"}]}))
    env = {"HOME": str(home)}
    port = free_port()
    with running(batching(tiny_model, bundles, port, *cache), port, tmp_path / "warm.log", env):
        with ThreadPoolExecutor(8) as pool:  # 8 at once on the fresh bundle
            together = list(pool.map(lambda q: chat(port, body(tiny_model, q))[0], QUESTIONS))
        # a request parting inside the bundle, then one reusing it whole: the pin is unchanged
        parted = body(tiny_model)
        parted["messages"][0]["content"] = parted["messages"][0]["content"][:200] + " Be brief."
        chat(port, parted)
        one_by_one = [chat(port, body(tiny_model, q))[0] for q in QUESTIONS]
    log = (tmp_path / "warm.log").read_text()
    assert "1 bundle(s) mounted, 1 refused" in log and "Traceback" not in log
    assert "its own on-disk prefix cache is not loaded under serve" in log
    assert "its own on-disk prefix cache is not written under serve" in log
    assert sorted(p.name for p in own.parent.iterdir()) == ["stale"]
    served = covered(log.split("vllm-mlx: warmed up its generation path")[1])
    assert served[0] == count and len(served) == 2 * len(QUESTIONS) + 1
    assert together[0]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert [r["choices"][0]["message"] for r in together] == [
        r["choices"][0]["message"] for r in one_by_one
    ]

    empty = tmp_path / "none"
    empty.mkdir()
    port = free_port()
    with running(batching(tiny_model, empty, port, *cache), port, tmp_path / "cold.log", env):
        cold = [chat(port, body(tiny_model, q))[0] for q in QUESTIONS]
    assert [r["choices"][0]["message"] for r in cold] == [
        r["choices"][0]["message"] for r in one_by_one
    ]
    assert cold[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.slow
def test_prefix_caches_the_hook_does_not_fill_are_refused_with_one_line(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path
):
    import subprocess

    for option, serve_option, why in (
        ("--disable-prefix-cache", [], "with --continuous-batching"),
        ("--use-paged-cache", ["--bundle-memory", "1MiB"], "with --bundle-memory"),  # all held
    ):
        args = batching(tiny_model, shop_bundle.parents[2], free_port(), option)
        args[args.index("serve") + 1 : args.index("serve") + 1] = serve_option
        proc = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=300)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and lines[-1].startswith(
            f"error: serve --server vllm-mlx: {option} is not supported: {why}"
        ), proc.stderr[-2000:]
