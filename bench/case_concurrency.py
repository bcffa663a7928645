"""Case concurrency: the batched engines' throughput when many clients arrive at once, with bundles
(`serve --server NAME`) vs the same engine run plainly, on the demo's support-agent prefix.

vllm-mlx `--continuous-batching` and rapid-mlx (their BatchedEngine) serve concurrent requests in
one batch. Right after startup, CLIENTS clients send their first question on the same 11k-token
prefix (--quick: shortened) at once (the burst a deploy, restart or scale-out meets): a plain engine prefills the prefix
for the ones it cannot yet share, with bundles each reuses the mounted prefix. Then a second burst of
CLIENTS other questions on the now-warm server. Per burst: wall seconds until the last answer,
requests per second, prompt tokens per second (the server's usage), the cached tokens each request
reports, and whether every answer equals the plain engine's for the same question (temperature 0).
--quick: the first engine installed (ENGINES' order), QUICK_CLIENTS clients, one fresh server each
for plain and bundles.

Standalone: `python bench/case_concurrency.py [--quick]` prints the markdown section.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent)]

import serving  # noqa: E402
from common import REPO, Context, clean_env, free_port, ratio, standalone, stat, wait_ready  # noqa: E402
from serving import request_body  # noqa: E402

# the batched engines: {row: (server, its options)}; --quick runs the first one installed, with
# QUICK_CLIENTS clients
ENGINES = {
    "rapid-mlx": ("rapid-mlx", ()),
    "vllm-mlx --continuous-batching": ("vllm-mlx", ("--continuous-batching",)),
}
CLIENTS, QUICK_CLIENTS = 8, 2
# two bursts of CLIENTS distinct questions: the first right after startup, the second once warm
QUESTIONS = [
    "How do I reset my password if I no longer have access to my email?",
    "Can I change the billing date of my subscription?",
    "Why was my account locked after three login attempts?",
    "How do I export all my invoices as PDF?",
    "Is there a way to add a second admin to our workspace?",
    "My order arrived damaged. What are my options?",
    "How do I cancel my trial before it converts to a paid plan?",
    "Can I move my data to the EU region?",
    "What happens to my files if I downgrade to the free plan?",
    "How do I turn off the weekly summary emails?",
    "The mobile app crashes when I open settings. What should I try?",
    "Do you offer discounts for non-profit organisations?",
    "How do I update the VAT number on my invoices?",
    "Can two people share one seat on the team plan?",
    "I forgot which email I signed up with. How can I find out?",
    "How long do you keep deleted projects before they are gone for good?",
]


def _ask(port: int, question: str, quick: bool) -> tuple[str | None, int | None, int | None]:
    """(answer, prompt tokens, cached tokens) of one chat request."""
    body = request_body("full", quick)
    body["messages"][-1]["content"] = question
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=3600) as resp:
        answer = json.loads(resp.read())
    usage = answer.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return answer["choices"][0]["message"].get("content"), usage.get("prompt_tokens"), cached


def burst(port: int, questions: list[str], quick: bool) -> dict[str, Any]:
    """All questions at once, one client each: wall seconds until the last answer and per-question
    answers, prompt and cached tokens."""
    start = time.perf_counter()
    with ThreadPoolExecutor(len(questions)) as pool:
        got = list(pool.map(lambda q: _ask(port, q, quick), questions))
    seconds = time.perf_counter() - start
    prompt = sum(p or 0 for _, p, _ in got)
    return {
        "s": seconds,
        "requests_per_s": len(questions) / seconds,
        "prompt_tokens_per_s": prompt / seconds,
        "answers": [a for a, _, _ in got],
        "cached": [c for _, _, c in got],
    }


def bursts(
    ctx: Context, label: str, args: list[str], env: dict[str, str], clients: int
) -> dict[str, Any]:
    """A fresh server (fresh HOME: no disk cache of its own from an earlier run), the first burst
    right after it is ready, then the warm burst; stopped by its pid."""
    port = free_port()
    home = ctx.work / "home"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    log = ctx.work / f"concurrency-{label.replace(' ', '-').replace('/', '-')}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*args, "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=clean_env(HOME=str(home), **env),
            cwd=REPO,
        )
        try:
            wait_ready(port, proc)
            first = burst(port, QUESTIONS[:clients], ctx.quick)
            warm = burst(port, QUESTIONS[clients : 2 * clients], ctx.quick)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    ctx.note(f"concurrency: {label}: first burst {first['s']:.1f} s, warm burst {warm['s']:.1f} s")
    return {"first": first, "warm": warm}


def engines(ctx: Context, bundles: Path, clients: int) -> dict[str, dict[str, Any]]:
    """{engine: {"plain": bursts, "bundles": bursts}} for each batched engine installed here
    (--quick: the first)."""
    from pipeline.blas import blas_status

    openblas = blas_status().library
    preload = {"LD_PRELOAD": openblas} if openblas else {}
    runs = {}
    for row, (server, options) in ENGINES.items():
        venv = serving.venv_of(server)
        if venv is None:
            ctx.note(f"concurrency: {row} skipped: its server is not installed here")
            continue
        plain = serving.plain(server, venv)
        runs[row] = ([*plain, *options], serving.serve(server, venv, bundles, *options))
        if ctx.quick:
            break
    reps = 1 if ctx.quick else 3
    result: dict[str, dict[str, Any]] = {}
    for engine, (plain, with_bundles) in runs.items():
        got: dict[str, list[dict[str, Any]]] = {"plain": [], "bundles": []}
        for rep in range(reps):  # alternating, a fresh server each
            for kind in ("plain", "bundles") if rep % 2 == 0 else ("bundles", "plain"):
                args, env = (plain, preload) if kind == "plain" else (with_bundles, {})
                label = f"{engine} {kind} {rep + 1}"
                got[kind].append(bursts(ctx, label, args, env, clients))
        result[engine] = {kind: summarized(runs_of, clients) for kind, runs_of in got.items()}
    return result


def summarized(runs: list[dict[str, Any]], clients: int) -> dict[str, Any]:
    """Per burst: wall seconds as a statistic, rates of its median, the first run's answers and
    every run's cached tokens."""
    out = {}
    for name in ("first", "warm"):
        bursts_of = [r[name] for r in runs]
        wall = stat([b["s"] for b in bursts_of])
        prompt_per_request = bursts_of[0]["prompt_tokens_per_s"] * bursts_of[0]["s"] / clients
        out[name] = {
            "s": wall.as_dict(),
            "requests_per_s": clients / wall.median,
            "prompt_tokens_per_s": prompt_per_request * clients / wall.median,
            "answers": bursts_of[0]["answers"],
            "same_answers_every_run": all(
                b["answers"] == bursts_of[0]["answers"] for b in bursts_of
            ),
            "cached": [c for b in bursts_of for c in b["cached"]],
        }
    return out


def run(ctx: Context, bundles: str) -> dict[str, Any]:
    """Each batched engine's bursts (--quick: the first installed, fewer clients)."""
    clients = QUICK_CLIENTS if ctx.quick else CLIENTS
    return {"clients": clients, "engines": engines(ctx, Path(bundles), clients)}


def cell(s: dict[str, Any]) -> str:
    """Median wall seconds, with min–max and n when repeated."""
    spread = f" ({s['min']:.1f}–{s['max']:.1f}, n={s['n']})" if s["n"] > 1 else ""
    return f"{s['median']:.1f}{spread}"


def section(result: dict[str, Any]) -> list[str]:
    """Markdown for RESULTS.md."""
    n = result["clients"]
    lines = [
        f"## Concurrency: {n} clients at once on the batched engines, with bundles vs plain",
        "",
        f"Demo model `models/demo-tiny`, support-agent prefix (11,052 tokens, 8 tools; a --quick "
        f"run: shortened to about 2,000, the cached column says); a fresh "
        f"server per run (plain: the engine's own command with OpenBLAS preloaded; bundles: "
        f"`serve --server NAME`, its defaults). Right after startup {n} clients each send their "
        f"first question at once (first burst), then {n} other questions (warm burst); 8 tokens "
        "at temperature 0. Wall seconds until the last answer (median, min–max, n fresh servers, "
        "plain and bundles alternating), requests and prompt tokens per second at the median, "
        "the cached tokens the requests report (min–max over every run; vllm-mlx run plainly "
        "reports none), and whether each answer equals the plain engine's for the same question "
        "in every run.",
        "",
        "| engine | run | burst | wall s | requests/s | prompt tok/s | cached per request "
        "| same answers as plain |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for engine, runs in result["engines"].items():
        for run_name, run in runs.items():
            for burst_name in ("first", "warm"):
                b = run[burst_name]
                same = b["answers"] == runs["plain"][burst_name]["answers"]
                same = same and b["same_answers_every_run"]
                cached = [c or 0 for c in b["cached"]]
                lines.append(
                    f"| {engine} | {run_name} | {burst_name} | {cell(b['s'])} "
                    f"| {b['requests_per_s']:.2f} | {b['prompt_tokens_per_s']:,.0f} "
                    f"| {min(cached):,}–{max(cached):,} | {same} |"
                )
        first = ratio(
            runs["plain"]["first"]["s"]["median"], runs["bundles"]["first"]["s"]["median"]
        )
        warm = ratio(runs["plain"]["warm"]["s"]["median"], runs["bundles"]["warm"]["s"]["median"])
        lines.append(
            f"| {engine} | speed-up | | first burst {first:.1f}x, warm burst {warm:.2f}x | | | | |"
        )
    return [*lines, ""]


if __name__ == "__main__":
    standalone("concurrency", lambda ctx: run(ctx, serving.bundles(ctx)), section)
