"""`serve --server mlx-omni-server`: omni 0.5.3's own chat route (OpenAI router -> ChatGenerator ->
PromptCachePool) over loopback HTTP in the server venv, prepared by serve's own code
(tests/envs/omni_chat_app.py; omni's full app needs mflux, which does not install on Linux)."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.error
from pathlib import Path

import pytest
from servers_env import (
    QUESTION,
    ROOT,
    after_warm_up,
    body,
    chat,
    free_port,
    running_together,
    servers_python,
)

from pipeline.format.manifest import Manifest

APP = ROOT / "tests" / "envs" / "omni_chat_app.py"
NEXT_TURN = [
    {"role": "assistant", "content": "Let me look."},
    {"role": "user", "content": "Thanks."},
]


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


def cold_spelling(model: Path, n: int) -> str:
    """The model folder spelled anew: omni builds a ChatGenerator (an empty pool) per spelling."""
    return str(model) + "/." * n


def ask(port: int, body: dict) -> dict | int:
    """A chat answer, or the HTTP status of an error (omni 0.5.3 answers max_tokens 1 with 500)."""
    try:
        return chat(port, body)[0]
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.slow
def test_omnis_own_entries_continue_exactly_where_their_kv_ends(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path
):
    """omni stores KV one token ahead of the tokens it records and re-feeds the last token of an
    exact hit: a request that extends an entry, repeats it or shares part of it continued one
    position off (issue 48.3). Each answer equals a cold omni's (a fresh pool per request)."""
    python = servers_python()
    port, cold_port, empty = free_port(), free_port(), tmp_path / "none"
    empty.mkdir()
    warm_server = (omni(python, tiny_model, shop_bundle.parents[2], port), port, tmp_path / "w.log")
    cold_server = (omni(python, tiny_model, empty, cold_port), cold_port, tmp_path / "c.log")
    first = body(str(tiny_model), QUESTION)
    turns = [
        {**first, "max_tokens": 10},  # exactly the tokens the max_tokens 1 request recorded
        {**first, "messages": [*first["messages"], *NEXT_TURN]},  # extends them all
        body(str(tiny_model), "And my order 777?"),  # shares part of an entry
    ]
    with running_together([warm_server, cold_server]):
        assert ask(port, {**first, "max_tokens": 1}) in (500, 200)  # stores its entry either way
        warm = [ask(port, turn) for turn in turns]
        cold = [
            ask(cold_port, {**t, "model": cold_spelling(tiny_model, i + 1)})
            for i, t in enumerate(turns)
        ]
    assert [w["choices"][0]["message"] for w in warm] == [c["choices"][0]["message"] for c in cold]
    cached = [w["usage"]["prompt_tokens_details"]["cached_tokens"] for w in warm]
    prompts = [w["usage"]["prompt_tokens"] for w in warm]
    assert cached[:2] == [prompts[0] - 1, prompts[0]], (cached, prompts)  # omni's own entries
    assert "no bundle covers" in (tmp_path / "c.log").read_text()


@pytest.mark.slow
def test_omnis_pool_hands_out_an_entry_only_for_what_the_rule_lets_a_request_keep(
    tiny_model: Path,
):
    """omni's own PromptCachePool and PromptCache under serve's hook: every checkout continues
    where its KV ends, an exact hit leaves one token, and a 4-bit entry serves half its tokens
    or more, else is never handed out, not even trimmed to nothing (issue 48.3 and 48.8)."""
    python = servers_python()
    worker = ROOT / "tests" / "envs" / "omni_pool_worker.py"
    done = subprocess.run(
        [str(python), str(worker), str(tiny_model)], capture_output=True, text=True, timeout=300,
        cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # [tokens reused, tokens processed, KV offset continued from, the KV is quantized]
    assert json.loads(done.stdout.splitlines()[-1]) == {
        "extends": [24, 2, 24, False],
        "shares part": [20, 2, 20, False],
        "exact": [23, 1, 23, False],
        "4-bit half": [12, 1, 12, True],
        "4-bit under half": [0, 13, 0, False],
        "4-bit one token": [0, 4, 0, False],
    }
