"""The cache-kind matrix through every other server serve wraps (issue 22.4): vllm-mlx,
mlx-openai-server and mlx-omni-server (its chat route), each in the server venv over loopback HTTP.

Per server and model, one warm server holds one bundle per cache kind of that model (qwen3: full,
8-bit, 4-bit; gemma3: rotating, rotating+8-bit; lfm2: hybrid, hybrid+8-bit), takes one request
per bundle on its own, then one per bundle at once, then one matching no bundle; a cold server of
the same kind (no bundles) takes the same requests. Answers must be equal, the bundles reused,
and the server healthy after (mlx-openai-server's BatchGenerator was broken for good by the raw
8-bit bundle, answering every later request with 'list index out of range').
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from servers_env import (
    ROOT,
    after_warm_up,
    chat,
    free_port,
    rapid_python,
    running_together,
    servers_python,
)
from test_serve_cache_kinds import DESK, KINDS, ONE_HEAD, build

from pipeline.format.bundle_folder import MANIFEST_FILE
from pipeline.testmodels.arch import generate_arch_model

from conftest import SYSTEM, TOOLS

LIBRARY = (
    "You are the desk of a public library. Answer in one sentence. Loans run three weeks and can "
    "be renewed twice; the reading room closes at 20:00."
)
TEXTS = (SYSTEM, DESK, LIBRARY)
GROUPS = {  # model -> (architecture, config overrides, the kinds built for it)
    "qwen3": ("qwen3", {}, ("full", "8-bit", "4-bit")),
    "gemma3": ("gemma3_text", {}, ("rotating", "rotating-8-bit")),
    "lfm2": ("lfm2", ONE_HEAD, ("hybrid", "hybrid-8-bit")),
}
# "vllm-mlx-batched": vllm-mlx --continuous-batching (its BatchedEngine, mlx-lm's BatchGenerator)
SERVERS = ("vllm-mlx", "vllm-mlx-batched", "mlx-openai-server", "mlx-omni-server")
# vllm-mlx 0.6.0's SimpleEngine uses no prompt cache for a model with RotatingKVCache layers (its
# own probe): serve must say so at startup and count none as mounted
NOT_USED = {("vllm-mlx", "gemma3")}
# "-paged": its paged prefix cache (--use-paged-cache: the bundles enter it as blocks, issue 52.4)
ENGINE_OPTIONS = {
    "vllm-mlx-batched": ["--continuous-batching"],
    "vllm-mlx-paged": ["--continuous-batching", "--use-paged-cache"],
    "rapid-mlx-paged": ["--use-paged-cache"],
}
QUESTIONS = ("Where is my order 12345?", "When is breakfast?", "Can I renew a loan?")


def command(
    server: str, python: Path, model: Path, bundles: Path, port: int, admin: int | None = None
) -> list[str]:
    entry = ROOT / ("tests/envs/omni_chat_app.py" if server == "mlx-omni-server" else "build.py")
    batched = ENGINE_OPTIONS.get(server, [])
    name = server.removesuffix("-batched").removesuffix("-paged")
    serve = ["--bundles", str(bundles), "serve", "--server", name]
    serve += ["--admin-port", str(admin)] if admin is not None else []
    return [str(python), str(entry), *serve, "--model", str(model), "--port", str(port), *batched]


def remount(admin: int) -> dict:
    """POST /v1/bundles/remount on the admin endpoint: its report."""
    req = urllib.request.Request(f"http://127.0.0.1:{admin}/v1/bundles/remount", method="POST")
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def request(model: Path, system: str | None, question: str) -> dict:
    messages = [{"role": "system", "content": system}] if system is not None else []
    return {
        "model": str(model),
        "messages": [*messages, {"role": "user", "content": question}],
        "tools": TOOLS,
        "max_tokens": 10,
        "temperature": 0.0,
    }


def patient_chat(port: int, body: dict) -> dict:
    """A chat answer; a 503 (vllm-mlx's SimpleEngine refuses a request while it serves another)
    is retried, as a client would."""
    for _ in range(100):
        try:
            return chat(port, body)[0]
        except urllib.error.HTTPError as exc:
            if exc.code != 503:
                raise
            time.sleep(0.1)
    raise AssertionError("the server stayed busy (503) for 10 s")


def ask_all(port: int, bodies: list[dict]) -> list[dict]:
    """Each body on its own, then all at once, then one matching no bundle."""
    answers = [chat(port, b)[0] for b in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers += list(pool.map(lambda b: patient_chat(port, b), bodies))
    answers.append(chat(port, request(Path(bodies[0]["model"]), None, "Hello?"))[0])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10):
        pass
    return answers


# rapid-mlx: its cache class is vllm-mlx-batched's (servers/memory_cache.py), which runs every
# group; rapid-mlx runs the one with the 4-bit bundle (the lossy remount), within CI's budget
# the paged engines hold plain KVCache layers only (rapid-mlx refuses others at its start): the
# qwen3 group, whose 8-bit and 4-bit bundles stay out of the blocks
CASES = [(s, g) for g in GROUPS for s in SERVERS] + [("rapid-mlx", "qwen3")]
CASES += [("vllm-mlx-paged", "qwen3"), ("rapid-mlx-paged", "qwen3")]


@pytest.mark.slow
@pytest.mark.parametrize(("server", "group"), CASES)
def test_every_cache_kind_answers_like_the_server_cold(
    server: str, group: str, tiny_model: Path, tmp_path: Path
):
    python = rapid_python() if server.startswith("rapid-mlx") else servers_python()
    arch, overrides, kinds = GROUPS[group]
    model = generate_arch_model(tmp_path / "model", arch, tiny_model, **overrides)
    names = []
    for i, kind in enumerate(kinds):
        _, _, _, cache, classes = KINDS[kind]
        name = f"p{i}"
        bundle = build(tmp_path, model, name, TEXTS[i], cache)
        assert json.loads((bundle / MANIFEST_FILE).read_text())["cache"]["classes"] == classes
        names.append(name)
    bodies = [request(model, TEXTS[i], QUESTIONS[i]) for i in range(len(kinds))]
    # after the requests, every lossy bundle is removed and remounted: whatever the server kept
    # from it must not serve a request that shares only its opening tokens (issue 37.1)
    used = (server, group) not in NOT_USED  # else none is mounted: nothing to remount
    lossy = [n for n, k in zip(names, kinds, strict=True) if "bit" in k and used]
    user_only = request(model, None, "Hello?")
    port, admin, cold_port = free_port(), free_port(), free_port()
    log, empty = tmp_path / "warm.log", tmp_path / "none"
    empty.mkdir()
    warm_server = (command(server, python, model, tmp_path / "bundles", port, admin), port, log)
    cold_server = (command(server, python, model, empty, cold_port), cold_port, tmp_path / "c.log")
    with running_together([warm_server, cold_server]):
        warm, cold = ask_all(port, bodies), ask_all(cold_port, bodies)
        if lossy:
            for name in lossy:
                shutil.rmtree(tmp_path / "bundles" / name)
            report = remount(admin)
            assert sorted(report["removed"]) == sorted(f"{n}@1" for n in lossy), report
            warm.append(chat(port, user_only)[0])
            cold.append(chat(cold_port, user_only)[0])
    text = log.read_text()
    if (server, group) in NOT_USED:
        assert f"0 bundle(s) mounted, 0 refused, {len(kinds)} not usable" in text, text[-3000:]
        assert "reuses no prompt cache for this model's cache classes" in text
    else:
        assert f"{len(kinds)} bundle(s) mounted, 0 refused" in text, text[-3000:]
        clients = after_warm_up(text)
        for name in names:
            assert f"request: bundle {name}@1 covers" in clients, (name, text[-3000:])
    assert "Traceback" not in text and "list index out of range" not in text, text[-3000:]
    for i, (w, c) in enumerate(zip(warm, cold, strict=True)):
        assert w["choices"][0]["message"] == c["choices"][0]["message"], (server, group, i)


@pytest.mark.slow
def test_each_servers_own_cache_never_hands_out_an_exact_hit_with_nothing_to_process():
    """Issue 28.3 on the other servers: vllm-mlx's trie and mlx-openai-server's LRUPromptCache (the
    installed classes, through serve's hooks) holding an entry that cannot trim: asked for exactly
    its tokens, the lookup leaves at least one token (here: the entry is not used, nothing shorter
    exists, all 20 run cold); asked for one token more, the entry is used and 1 token is left."""
    import subprocess

    python = servers_python()
    done = subprocess.run(
        [str(python), str(ROOT / "tests" / "envs" / "exact_hit_worker.py")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    left = json.loads(done.stdout.splitlines()[-1])
    assert left == {"vllm-mlx": [20, 1], "mlx-openai-server": [20, 1]}
