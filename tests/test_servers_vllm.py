"""`serve --server vllm-mlx`: the real vllm-mlx 0.6.0 server process (in the server venv, mlx-lm
0.31) over loopback HTTP, with a bundle built here (mlx-lm 0.32) mounted by the one validator."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from servers_env import (
    ROOT,
    body,
    chat,
    free_port,
    running,
    running_together,
    servers_python,
    stream,
)

from pipeline.format.manifest import Manifest


def serve_args(python: Path, model: Path, bundles: Path, port: int, *extra: str) -> list[str]:
    return [
        str(python),
        str(ROOT / "build.py"),
        "--bundles",
        str(bundles),
        "serve",
        "--server",
        "vllm-mlx",
        "--model",
        str(model),
        "--port",
        str(port),
        *extra,
    ]


def anthropic_body(model: Path) -> dict:
    """servers_env.body as an Anthropic messages request: the system text, tools with
    input_schema."""
    chat_body = body(model)
    system = [m["content"] for m in chat_body["messages"] if m["role"] == "system"]
    tools = [
        {
            "name": t["function"]["name"],
            "description": t["function"].get("description", ""),
            "input_schema": t["function"]["parameters"],
        }
        for t in chat_body.get("tools") or []
    ]
    messages = [m for m in chat_body["messages"] if m["role"] != "system"]
    return {
        "model": str(model),
        "system": [{"type": "text", "text": s} for s in system],
        "messages": messages,
        "tools": tools,
        "max_tokens": 8,
        "temperature": 0.0,
    }


@pytest.mark.slow
def test_first_request_reuses_the_bundle_and_answers_as_a_cold_server(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path
):
    python = servers_python()
    manifest = Manifest.model_validate_json((shop_bundle / "manifest.json").read_text())
    port, cold_port, empty = free_port(), free_port(), tmp_path / "no-bundles"
    empty.mkdir()
    args = serve_args(python, tiny_model, shop_bundle.parents[2], port)
    cold_args = serve_args(python, tiny_model, empty, cold_port)
    warm_log, cold_log = tmp_path / "warm.log", tmp_path / "cold.log"
    with running_together([(args, port, warm_log), (cold_args, cold_port, cold_log)]):
        warm, _ = chat(port, body(tiny_model))
        cold, _ = chat(cold_port, body(tiny_model))
        again, _ = chat(port, body(tiny_model, "And my order 777?"))
        streamed = stream(
            port,
            "/v1/chat/completions",
            {**body(tiny_model), "stream_options": {"include_usage": True}},
        )
        anthropic = stream(port, "/v1/messages", anthropic_body(tiny_model))
    log = (tmp_path / "warm.log").read_text()
    assert "mounted shop@1" in log and "1 bundle(s) mounted, 0 refused" in log
    covered = [int(n) for n in re.findall(r"bundle shop@1 covers (\d+) of \d+ prompt tokens", log)]
    # serve's warm-up before the port opened, then all four requests, the first one included
    assert covered == [manifest.tokens.count] * 5
    assert "vllm-mlx: warmed up its generation path with shop@1's request" in log
    assert "Prefix trie cache HIT" in log  # vllm-mlx's own lookup took the bundle
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == manifest.tokens.count
    # streamed: the usage chunk, and Anthropic's message_start (sent before the lookup runs)
    usages = [e["usage"] for e in streamed if e.get("usage")]  # vllm-mlx: on several chunks
    assert usages and {u["prompt_tokens_details"]["cached_tokens"] for u in usages} == {
        manifest.tokens.count
    }
    (start,) = [e for e in anthropic if e.get("type") == "message_start"]
    assert start["message"]["usage"]["cache_read_input_tokens"] == manifest.tokens.count
    assert [e["type"] for e in anthropic][:2] == ["message_start", "content_block_start"]

    cold_text = cold_log.read_text()
    assert "0 bundle(s) mounted" in cold_text and "no bundle covers" in cold_text
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    assert warm["usage"]["prompt_tokens"] == cold["usage"]["prompt_tokens"]
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["message"]["content"] is not None


@pytest.mark.slow  # it runs in the server venv, which .ci/run makes while the fast tests run
def test_unsupported_option_is_refused_before_anything_is_mounted(tiny_model: Path, tmp_path: Path):
    python = servers_python()
    args = serve_args(python, tiny_model, tmp_path, 1, "--mllm")
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: serve --server vllm-mlx: --mllm is not supported: bundles hold text-model caches; "
        "multimodal routing is not hooked"
    )


def test_server_not_installed_is_one_error_line(tiny_model: Path, tmp_path: Path):
    import importlib.util

    if importlib.util.find_spec("vllm_mlx") is not None:
        pytest.skip("vllm-mlx is installed in this environment")
    args = [sys.executable, str(ROOT / "build.py"), "--bundles", str(tmp_path), "serve"]
    args += ["--server", "vllm-mlx", "--model", str(tiny_model)]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        "error: serve --server vllm-mlx: vllm-mlx is not installed in this Python environment "
        "(vllm_mlx cannot be imported); make its environment with 'python "
        f"{ROOT / 'build.py'} server-env vllm-mlx .venv-vllm-mlx', then run "
        "'.venv-vllm-mlx/bin/prefix-bundles' there "
        "(docs/servers.md)"
    )


@pytest.mark.slow
def test_with_prefix_trie_cache_the_servers_own_entries_work_next_to_the_bundle(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path
):
    python = servers_python()
    port = free_port()
    args = serve_args(python, tiny_model, shop_bundle.parents[2], port, "--prefix-trie-cache")
    with running(args, port, tmp_path / "trie.log"):
        first, _ = chat(port, body(tiny_model))
        second, _ = chat(port, body(tiny_model))
    log = (tmp_path / "trie.log").read_text().split("vllm-mlx: warmed up its generation path")[1]
    lines = re.findall(r"vllm-mlx request: bundle shop@1 covers .*", log)  # the warm-up's: none
    assert len(lines) == 2 and "the server's own cache" not in lines[0]
    # vllm-mlx 0.6.0 keys its trie by the (unhashable) model: under serve its own entry is found
    assert re.search(r"the server's own cache covers \d+, and is used", lines[1]), lines
    assert first["choices"][0]["message"] == second["choices"][0]["message"]


@pytest.mark.slow
def test_a_request_sharing_only_the_system_prompt_reuses_the_shared_part(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path
):
    python = servers_python()
    no_tools = {k: v for k, v in body(tiny_model).items() if k != "tools"}
    port, cold_port, empty = free_port(), free_port(), tmp_path / "no-bundles"
    empty.mkdir()
    args = serve_args(python, tiny_model, shop_bundle.parents[2], port)
    cold_args = serve_args(python, tiny_model, empty, cold_port)
    servers = [(args, port, tmp_path / "warm.log"), (cold_args, cold_port, tmp_path / "cold.log")]
    with running_together(servers):
        warm, _ = chat(port, no_tools)
        cold, _ = chat(cold_port, no_tools)
    log = (tmp_path / "warm.log").read_text().split("vllm-mlx: warmed up its generation path")[1]
    covered = [int(n) for n in re.findall(r"bundle shop@1 covers (\d+) of \d+ prompt tokens", log)]
    assert len(covered) == 1 and covered[0] > 0, log[-3000:]
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == covered[0]
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]


def messages(port: int, body: dict) -> dict:
    """One Anthropic /v1/messages request."""
    import json
    import urllib.request

    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/messages",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


@pytest.mark.slow
def test_a_claude_code_shaped_messages_request_is_warm_on_the_first_request(
    tiny_model: Path, tmp_path: Path
):
    import json

    from conftest import claude_code_request

    python = servers_python()
    project = tmp_path / "project"
    (project / "prefixes").mkdir(parents=True)
    request = tmp_path / "request.json"
    request.write_text(json.dumps(claude_code_request(str(tiny_model))))
    cli = [str(python), str(ROOT / "build.py"), "--prefixes", "prefixes"]
    for step in (
        ["new", "cc", "--model", str(tiny_model), "--from-request", str(request)],
        ["--bundles", "bundles", "build", "cc"],  # new reads no bundles folder: not given there
    ):
        proc = subprocess.run([*cli, *step], capture_output=True, text=True, cwd=project)
        assert proc.returncode == 0, proc.stderr[-3000:]
    (bundle,) = (project / "bundles").glob("cc/*/*")
    manifest = Manifest.model_validate_json((bundle / "manifest.json").read_text())
    assert manifest.request.api == "anthropic" and manifest.request.tokenization == ["vllm-mlx"]

    # another billing hash, as each Claude Code request carries
    asked = claude_code_request(str(tiny_model))
    asked["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1.3; cch=0a7c2;"
    port, cold_port, empty = free_port(), free_port(), tmp_path / "no-bundles"
    empty.mkdir()
    warm_server = (
        serve_args(python, tiny_model, project / "bundles", port),
        port,
        tmp_path / "w.log",
    )
    cold_server = (serve_args(python, tiny_model, empty, cold_port), cold_port, tmp_path / "c.log")
    with running_together([warm_server, cold_server]):
        warm, cold = messages(port, asked), messages(cold_port, asked)
    log = (tmp_path / "w.log").read_text()
    assert "requests will reuse at most" not in log
    assert "vllm-mlx: its own app computed the ids of 1 of 1 recorded bundle(s) exactly" in log
    log = log.split("vllm-mlx: warmed up its generation path")[1]
    covered = [int(n) for n in re.findall(r"bundle cc@1 covers (\d+) of \d+ prompt tokens", log)]
    assert covered == [manifest.tokens.count], log[-3000:]
    assert warm["usage"]["cache_read_input_tokens"] == manifest.tokens.count

    assert warm["content"] == cold["content"]
    assert cold["usage"]["cache_read_input_tokens"] == 0
    # Anthropic: input_tokens is the part not read from a cache; the client's sum is the prompt
    warm_total = warm["usage"]["input_tokens"] + warm["usage"]["cache_read_input_tokens"]
    assert warm_total == cold["usage"]["input_tokens"]
    assert warm["usage"]["input_tokens"] == cold["usage"]["input_tokens"] - manifest.tokens.count


@pytest.mark.slow
def test_the_warm_up_names_the_served_model_and_carries_the_api_key(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path
):
    """A server that checks the model name and a key: the warm-up request passes both checks
    (served name read from vllm-mlx once loaded, the key from --api-key) and leaves no entry."""
    import json
    import urllib.request

    manifest = Manifest.model_validate_json((shop_bundle / "manifest.json").read_text())
    port = free_port()
    key = "a-key-for-the-warm-up-test"
    extra = ("--served-model-name", "shop-model", "--api-key", key)
    args = serve_args(servers_python(), tiny_model, shop_bundle.parents[2], port, *extra)
    with running(args, port, tmp_path / "named.log"):
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=json.dumps(body("shop-model")).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
        )
        with urllib.request.urlopen(req, timeout=600) as resp:
            answer = json.loads(resp.read())
    log = (tmp_path / "named.log").read_text()
    assert "vllm-mlx: warmed up its generation path with shop@1's request" in log, log[-3000:]
    assert "warm-up failed" not in log
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == manifest.tokens.count


@pytest.mark.slow
def test_a_bundle_never_makes_vllm_mlx_colder_and_usage_reports_its_own_snapshot(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path
):
    """A system prompt no bundle holds (the bundle shares only the template's opening): vllm-mlx
    keeps its own system-prompt snapshot as it does without bundles, the second request reuses
    it, and `cached_tokens` says so (the trie lookup serve counts is skipped on a snapshot hit)."""
    python = servers_python()
    bundles = tmp_path / "bundles"
    shutil.copytree(shop_bundle, bundles / "shop" / "1" / shop_bundle.name)
    other = {
        "model": str(tiny_model),
        "messages": [
            {"role": "system", "content": "You are a weather assistant. " * 30},
            {"role": "user", "content": "Rain tomorrow?"},
        ],
        "max_tokens": 4,
        "temperature": 0.0,
    }
    results = {}
    for kind, folder in (("bundles", bundles), ("plain", tmp_path / "empty")):
        folder.mkdir(exist_ok=True)
        port = free_port()
        log = tmp_path / f"{kind}.log"
        with running(serve_args(python, tiny_model, folder, port), port, log):
            first, _ = chat(port, other)
            second, _ = chat(port, other)
        results[kind] = (first, second, log.read_text())
    (first, second, log), (plain_first, plain_second, _) = results["bundles"], results["plain"]
    assert "System KV cache HIT" in log.split("warmed up its generation path")[-1]
    reused = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert reused > 100  # the whole system prefix, from vllm-mlx's own snapshot
    assert second["choices"][0]["message"] == plain_second["choices"][0]["message"]
    assert first["choices"][0]["message"] == plain_first["choices"][0]["message"]
