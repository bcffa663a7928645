"""A bounded soak of every server serve wraps (issue 22.5): 120 mixed requests, 8 at a time
(bundle prefixes, partial overlaps, unrelated prompts, streaming, clients that disconnect
mid-stream), then the same round again. At temperature 0 the second round's answers equal the
first's, no request gets an error reply, and the server's resident memory (its process tree)
after the second round is within 10 % of after the first."""

from __future__ import annotations

import http.client
import json
import os
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from servers_env import ROOT, after_warm_up, free_port, running, servers_python
from test_serve_cache_kinds import DESK, build
from test_servers_cache_kinds import LIBRARY, command

from conftest import SYSTEM, TOOLS

ROUND = 120  # every (i % 4, i % 5) request form 6 times; 200 cost CI ~40 s more for no finding
# mlx-openai-server answers about one request a second here (its spawned handler and batch
# scheduler): 3 rounds of 200 took 206 s, of 60 still 69-176 s, the largest share of CI's budget;
# 32 keep every request kind (i % 4) 8 times per round, each with every stream form (i % 5: plain,
# streamed, hung up) at least once, and the memory check
ROUND_OF = {"mlx-openai-server": 32}
BUSY = "serialized route is busy"  # vllm-mlx's SimpleEngine serves one request at a time
PARALLEL = 8
# what a client hanging up mid-stream makes the servers print (mlx_lm.server's http.server, and
# vllm-mlx's async stream): expected, not a finding
HANGUPS = (
    "BrokenPipeError: [Errno 32] Broken pipe",
    "ConnectionResetError: [Errno 104] Connection reset by peer",
    "RuntimeError: async generator ignored GeneratorExit",
)
QUESTIONS = [f"Question number {i}: where is order {1000 + 37 * i}?" for i in range(10)]


def body(model: Path, i: int, stream: bool) -> dict:
    """Request i of a round: bundle prefixes, a partial overlap, an unrelated prompt."""
    kind = i % 4
    system = {0: SYSTEM, 1: DESK, 2: SYSTEM[: len(SYSTEM) // 2], 3: None}[kind]
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
    out = {"model": str(model), "messages": messages, "max_tokens": 4, "temperature": 0.0}
    if kind != 3:
        out["tools"] = TOOLS
    return out | ({"stream": True} if stream else {})


def post(port: int, data: dict, disconnect: bool = False, busy_frames: bool = False) -> str | None:
    """The answer's text (streamed or not); None for a client that hangs up mid-stream. A 503
    (vllm-mlx's SimpleEngine while it serves another request) is retried, as a client would."""
    for _ in range(600):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        try:
            conn.request(
                "POST",
                "/v1/chat/completions",
                json.dumps(data),
                {"Content-Type": "application/json"},
            )
            resp = conn.getresponse()
            if resp.status == 503:
                resp.read()
                time.sleep(0.05)
                continue
            assert resp.status == 200, (resp.status, resp.read()[:300])
            if disconnect:
                resp.read(20)
                return None  # conn.close() below drops the stream mid-way
            raw = resp.read().decode()
        finally:
            conn.close()
        if not data.get("stream"):
            return json.loads(raw)["choices"][0]["message"].get("content") or ""
        frames = [json.loads(x[6:]) for x in raw.splitlines() if x.startswith("data: {")]
        if busy_frames and any("error" in f for f in frames):
            time.sleep(0.05)  # vllm-mlx streams its 'busy' refusal as an error frame (500)
            continue
        assert all("choices" in f for f in frames), frames
        return "".join(
            (f["choices"][0].get("delta", {}).get("content") or "") for f in frames if f["choices"]
        )
    raise AssertionError("the server stayed busy (503) for 30 s")


def one_round(port: int, model: Path, server: str) -> list[str | None]:
    def run(i: int) -> str | None:
        stream = i % 5 in (3, 4)
        busy = server == "vllm-mlx"
        return post(port, body(model, i, stream), disconnect=i % 5 == 4, busy_frames=busy)

    with ThreadPoolExecutor(parallel(server)) as pool:
        return list(pool.map(run, range(ROUND_OF.get(server, ROUND))))


def parallel(server: str) -> int:
    """Requests at a time. mlx-omni-server 0.5.3's chat route is not safe under concurrency of its
    own: with no bundle at all, 125-140 of 200 answers differed between two identical rounds 8 at
    a time (measured here); it is soaked one request at a time, which answers alike."""
    return 1 if server == "mlx-omni-server" else PARALLEL


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (mlx-openai-server's handler child),
    once the last round's streams have wound down."""
    time.sleep(2)
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += (
                int(next(x for x in status.splitlines() if x.startswith("VmRSS:")).split()[1])
                * 1024
            )
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [
                    int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()
                ]
        except (OSError, StopIteration):
            continue
    return total


@pytest.mark.slow
@pytest.mark.parametrize("server", ["mlx-lm", "vllm-mlx", "mlx-openai-server", "mlx-omni-server"])
def test_two_rounds_of_mixed_requests_answer_alike_with_flat_memory(
    server: str, tiny_model: Path, tmp_path: Path
):
    for name, text, cache in (
        ("shop", SYSTEM, {}),
        ("desk", DESK, {"kv_bits": 8}),
        ("lib", LIBRARY, {}),
    ):
        build(tmp_path, tiny_model, name, text, cache)
    port = free_port()
    if server == "mlx-lm":
        import sys

        args = [sys.executable, str(ROOT / "build.py"), "--bundles", str(tmp_path / "bundles"),
                "serve", "--model", str(tiny_model), "--port", str(port)]  # fmt: skip
    else:
        args = command(server, servers_python(), tiny_model, tmp_path / "bundles", port)
    log = tmp_path / "soak.log"
    with running(args, port, log) as proc:
        # a round to reach steady state first: the server's LRU fills and MLX's buffer cache
        # grows to the batch's working set (measured: +3 to +25 MiB over the first round on a
        # ~170 MiB process, then flat for 6 more rounds); a leak shows as growth after that
        one_round(port, tiny_model, server)
        first = one_round(port, tiny_model, server)
        after_first = tree_rss(proc.pid)
        second = one_round(port, tiny_model, server)
        after_second = tree_rss(proc.pid)
        third, after_third = None, None
        if after_second > after_first * 1.10:  # a step, or a trend? one more round tells
            third = one_round(port, tiny_model, server)
            after_third = tree_rss(proc.pid)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10):
            pass
    text = log.read_text()
    # a client that hangs up mid-stream makes mlx_lm.server's http.server print its broken pipe;
    # any other exception a traceback ends with is a finding
    raised = re.findall(r"^[A-Za-z_.]+(?:Error|Exception): .*$", text, flags=re.MULTILINE)
    assert set(raised) <= set(HANGUPS), sorted(set(raised))[:5]
    # every error vllm-mlx logged is its refusal of a second request while it serves one (retried)
    errors = [x for x in text.splitlines() if " - ERROR - " in x and "Task exception" not in x]
    assert all(BUSY in x for x in errors), errors[:3]
    assert first == second
    clients = after_warm_up(text)
    assert "bundle shop@1 covers" in clients and "bundle desk@1 covers" in clients
    growth = after_second / after_first - 1
    print(
        f"soak {server}: rss {after_first / 2**20:.0f} -> {after_second / 2**20:.0f} MiB ({growth:+.1%})"
    )
    if third is None:
        assert abs(growth) <= 0.10, (after_first, after_second)
    else:
        # measured on mlx_lm.server (~175 MiB): in about one run in four, one round steps RSS up by
        # 15-20 MiB (MLX's buffer cache taking a larger batch's working set) and it then stays
        # flat for 6 more rounds; a leak grows on every round
        assert third == first
        assert after_third <= after_second * 1.02, (after_first, after_second, after_third)
