"""Every server's own entries, continued by that server: the K/V it is handed holds exactly the
tokens it is told are cached (never one ahead or behind: issue 48.3), and its answers equal the
same server's with nothing reused. Real serve processes over loopback HTTP, each lookup recorded by
tests/envs/checkout_driver.py (build.py's main, unchanged, with the rule's answer logged)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from servers_env import (
    QUESTION,
    ROOT,
    body,
    chat,
    free_port,
    rapid_python,
    running_together,
    servers_python,
)

DRIVER = ROOT / "tests" / "envs" / "checkout_driver.py"
NEXT_TURN = [
    {"role": "assistant", "content": "Let me look."},
    {"role": "user", "content": "Thanks."},
]
SERVERS = {  # (python, serve options): each server's own prompt cache in use
    "mlx_lm.server batched": (lambda: Path(sys.executable), []),  # mlx-lm 0.32
    "mlx_lm.server 0.31 batched": (servers_python, []),
    "vllm-mlx": (servers_python, ["--server", "vllm-mlx", "--prefix-trie-cache"]),
    "vllm-mlx batched": (servers_python, ["--server", "vllm-mlx", "--continuous-batching"]),
    "vllm-mlx batched, chunked prefill": (
        servers_python,
        ["--server", "vllm-mlx", "--continuous-batching", "--chunked-prefill-tokens", "64"],
    ),
    "rapid-mlx": (rapid_python, ["--server", "rapid-mlx"]),
}


def serve(python: Path, model: Path, port: int, log: Path, cold: bool, options: list) -> list[str]:
    """serve through the driver (`cold`: reusing nothing), no bundles: the server's own entries."""
    driver = [str(python), str(DRIVER), str(log), *(["--cold"] if cold else [])]
    args = ["--bundles", str(log.parent / "none"), "serve", "--model", str(model)]
    return [*driver, *args, "--port", str(port), "--no-warm-up", *options]


def turns(model: Path) -> list[dict]:
    """A max_tokens 1 request, then its exact prompt, one extending it, one sharing part of it."""
    first = body(str(model), QUESTION)
    return [
        {**first, "max_tokens": 1},  # leaves an entry ending at its one answer token
        {**first, "max_tokens": 10},  # exactly that prompt again
        {**first, "messages": [*first["messages"], *NEXT_TURN]},  # extends it
        body(str(model), "And my order 777?"),  # shares part of it
        {**first, "max_tokens": 10},  # after an entry with a finished answer
        {**first, "messages": [*first["messages"], *NEXT_TURN]},
    ]


def together(port: int, model: Path) -> list[dict]:
    """Three requests at once, of different lengths, each extending an entry of `turns`."""
    first = body(str(model), QUESTION)
    longer = [*first["messages"], *NEXT_TURN, {"role": "assistant", "content": "Found it."}]
    bodies = [
        {**first, "messages": [*longer, {"role": "user", "content": "Bye."}]},
        {
            **first,
            "messages": [*first["messages"], *NEXT_TURN[:1], {"role": "user", "content": "?"}],
        },
        body(str(model), "And my order 777? It is late."),
    ]
    with ThreadPoolExecutor(3) as pool:
        return list(pool.map(lambda b: retried(port, b), bodies))


def retried(port: int, request: dict) -> dict:
    """A chat answer, asked again while the server is busy (vllm-mlx's SimpleEngine answers a
    request that comes while it serves another with 503), as a client would."""
    for _ in range(300):
        try:
            return chat(port, request)[0]
        except urllib.error.HTTPError as exc:
            if exc.code != 503:
                raise
            time.sleep(0.2)
    raise AssertionError("busy for a minute")


def answers(replies: list[dict]) -> list[dict]:
    return [r["choices"][0]["message"] for r in replies]


def lookups(log: Path) -> list[dict]:
    """Every lookup the driver recorded; each reuse handed K/V exactly as long as it claims."""
    found = [json.loads(line) for line in log.read_text().splitlines()]
    assert all(x["offset"] == x["cached"] < x["tokens"] for x in found if x["cached"]), found
    return found


@pytest.mark.slow
@pytest.mark.parametrize("server", list(SERVERS))
def test_own_entries_continue_exactly_where_their_kv_ends(
    server: str, tiny_model: Path, tmp_path: Path
):
    find_python, options = SERVERS[server]
    python = find_python()
    port, cold_port, warm_log = free_port(), free_port(), tmp_path / "warm.jsonl"
    (tmp_path / "none").mkdir()
    servers = [
        (serve(python, tiny_model, port, warm_log, False, options), port, tmp_path / "w.log"),
        (
            serve(python, tiny_model, cold_port, tmp_path / "cold.jsonl", True, options),
            cold_port,
            tmp_path / "c.log",
        ),
    ]
    with running_together(servers, {"HOME": str(tmp_path)}):
        warm = [chat(port, t)[0] for t in turns(tiny_model)] + together(port, tiny_model)
        cold = [chat(cold_port, t)[0] for t in turns(tiny_model)] + together(cold_port, tiny_model)
    found = lookups(warm_log)
    assert sum(1 for x in found if x["cached"]) >= 7, found  # its own entries were handed out
    assert answers(warm) == answers(cold), found


@pytest.mark.slow
@pytest.mark.parametrize("server", ["vllm_mlx", "rapid_mlx"])
def test_memory_aware_entries_are_continued_where_their_kv_ends(server: str):
    """The batched engines' own MemoryAwarePrefixCache under serve's hook: an entry stored as
    vllm-mlx's prompt_cache_save stores one (its prompt's key, K/V one token short) was handed out
    one position behind on an exact hit (trimmed again), a prefix and a shared-part match; each
    check-out now holds K/V exactly as long as the tokens the scheduler is told are cached."""
    python = servers_python() if server == "vllm_mlx" else rapid_python()
    worker = ROOT / "tests" / "envs" / "memory_cache_worker.py"
    done = subprocess.run(
        [str(python), str(worker), server], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # [tokens the scheduler is told are cached, K/V offset it continues from]
    assert json.loads(done.stdout.splitlines()[-1]) == {
        "prompt, K/V one short: exact": [199, 199],
        "prompt, K/V one short: extends": [199, 199],
        "prompt, K/V one short: shares part": [149, 149],
        "prompt and answer: exact": [199, 199],
        "prompt and answer: extends": [200, 200],
        "prompt and answer: shares part": [150, 150],
    }
