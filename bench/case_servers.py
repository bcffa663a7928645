"""Case servers: each non-default server's first request with bundles (`serve --server NAME`) vs the
same server's first request cold and vs its in-memory hit (the next question on the same prefix), on
the demo's
support-agent prefix (11,052 tokens), same answer; then, in the same process, the request with the
system prompt only (no tools: it shares part of the bundle) and, on vllm-mlx, the same prefix as
an Anthropic /v1/messages request, with the tokens each reused (the server's usage fields).

Runs in the server venv (tests/envs/make_servers_env.sh; vllm-mlx, omni and mlx-openai-server pin
mlx-lm 0.31). vllm-mlx is measured as a real server over loopback HTTP: plain `vllm-mlx serve` as
installed (mlx's own BLAS), plain with OpenBLAS preloaded (what `serve` loads), and `serve --server
vllm-mlx`. Standalone: `python bench/case_servers.py [--quick]` prints the markdown section.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent)]

from common import (  # noqa: E402
    REPO,
    Context,
    clean_env,
    free_port,
    post_json,
    ratio,
    standalone,
    stat,
    wait_ready,
)

MODEL = REPO / "models" / "demo-tiny"
VENV = Path(os.environ.get("PREFIX_BUNDLES_SERVERS_VENV", REPO / ".venv-servers"))
RAPID_VENV = Path(os.environ.get("PREFIX_BUNDLES_RAPID_VENV", REPO / ".venv-rapid"))
PREFIX = REPO / "prefixes" / "support-agent"
QUESTION = "My 2FA codes stopped working after I changed phones. How do I get back in?"
# the in-memory hit: the next client's question on the same prefix (a warm server has the prefix,
# never this question); about the same length as QUESTION
NEXT_QUESTION = "I was charged twice for my annual plan this month. Can you refund one of them?"


def request_body(kind: str = "full") -> dict[str, Any]:
    """The support-agent prefix (system text + 8 tools) and one question, temperature 0; "next"
    asks the next question instead; "system" leaves the tools out; "anthropic" is the same request
    as an Anthropic messages body."""
    question = NEXT_QUESTION if kind == "next" else QUESTION
    system = (PREFIX / "system.md").read_text()
    tools = json.loads((PREFIX / "tools.json").read_text())
    if kind == "anthropic":
        return {
            "model": str(MODEL),
            "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": question}],
            "tools": [
                {
                    "name": t["function"]["name"],
                    "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"],
                }
                for t in tools
            ],
            "max_tokens": 8,
            "temperature": 0.0,
        }
    body = {
        "model": str(MODEL),
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": 8,
        "temperature": 0.0,
    }
    return body if kind == "system" else {**body, "tools": tools}


def _post(port: int, kind: str) -> tuple[float, str | None, int | None]:
    """(seconds, answer, cached tokens the usage reports) of one request."""
    route = "/v1/messages" if kind == "anthropic" else "/v1/chat/completions"
    seconds, answer = post_json(port, route, request_body(kind))
    usage = answer.get("usage") or {}
    if kind == "anthropic":
        text = "".join(b.get("text") or "" for b in answer.get("content") or [])
        return seconds, text, usage.get("cache_read_input_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return seconds, answer["choices"][0]["message"].get("content"), cached


def first_request(
    args: list[str], port: int, log: Path, env: dict[str, str], kinds: tuple[str, ...]
) -> dict[str, Any]:
    """Start a server, time startup, its first request, the next question on the same prefix (the
    in-memory hit: what a warm server costs a new client), the first request again (a repeat: the
    whole prompt is in memory, which no prefix cache can give a new question), then one request of
    each other kind; stop it by its pid."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        try:
            wait_ready(port, proc)
            ready = time.perf_counter() - start
            first, answer, cached = _post(port, "full")
            hit = _post(port, "next")[0]
            repeat = _post(port, "full")[0]
            others = {kind: _post(port, kind) for kind in kinds}
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    row = {"startup_s": ready, "first_s": first, "hit_s": hit, "repeat_s": repeat}
    row |= {"answer": answer, "cached": cached}
    for kind, (seconds, other_answer, other_cached) in others.items():
        row[kind] = {"s": seconds, "answer": other_answer, "cached": other_cached}
    return row


def measure(
    ctx: Context, server: str, runs: dict[str, tuple], kinds: tuple[str, ...] = ("system",)
) -> dict[str, Any]:
    """{label: (command line without --port, extra env, repetitions)} -> rows of first requests."""
    rows = {}
    for label, (cmd, env, n) in runs.items():
        got = []
        for i in range(n):
            port = free_port()
            log = ctx.work / f"{server}-{len(rows)}-{i}.log"
            args = [*cmd, "--port", str(port)]
            # a fresh HOME per run: vllm-mlx and rapid-mlx load their own on-disk prefix caches
            # (~/.cache/...) saved by an earlier run, which would make a cold run warm
            home = ctx.work / "home"
            shutil.rmtree(home, ignore_errors=True)
            home.mkdir()
            env = {"HOME": str(home), **env}
            got.append(first_request(args, port, log, clean_env(**env), kinds))
            ctx.note(
                f"servers: {server} {label}: first request {got[-1]['first_s']:.2f} s, "
                f"hit {got[-1]['hit_s']:.2f} s, repeat {got[-1]['repeat_s']:.2f} s"
            )
        rows[label] = {
            "first_s": stat([g["first_s"] for g in got]).as_dict(),
            "hit_s": stat([g["hit_s"] for g in got]).as_dict(),
            "repeat_s": stat([g["repeat_s"] for g in got]).as_dict(),
            "startup_s": stat([g["startup_s"] for g in got]).as_dict(),
            "answers": sorted({g["answer"] for g in got}),
            "cached": sorted({g["cached"] for g in got}, key=str),
            **{
                kind: {
                    "s": stat([g[kind]["s"] for g in got]).as_dict(),
                    "answers": sorted({g[kind]["answer"] for g in got}),
                    "cached": sorted({g[kind]["cached"] for g in got}, key=str),
                }
                for kind in kinds
            },
        }
    return rows


def serve(bundles: Path, server: str | None, *options: str) -> list[str]:
    """`build.py serve [OPTIONS] [--server NAME]` in the server venv (no NAME: mlx_lm.server)."""
    python = str(VENV / "bin" / "python")
    named = [] if server is None else ["--server", server]
    cli = [python, str(REPO / "build.py"), "--bundles", str(bundles), "serve", *options]
    return [*cli, *named, "--model", str(MODEL)]


def mlx_lm(ctx: Context, bundles: Path, empty: Path, openblas: str | None) -> dict[str, Any]:
    """mlx_lm.server: plain with OpenBLAS, serve with no bundle, with bundles (the warm-up on,
    the default, and off)."""
    plain = [str(VENV / "bin" / "python"), "-m", "mlx_lm", "server", "--model", str(MODEL)]
    n = 1 if ctx.quick else 3
    return measure(
        ctx,
        "mlx_lm.server",
        {
            "cold, OpenBLAS preloaded": (plain, {"LD_PRELOAD": openblas} if openblas else {}, 1),
            **({} if ctx.quick else {"cold, serve with no bundle": (serve(empty, None), {}, 1)}),
            "bundles (serve)": (serve(bundles, None), {}, n),
            "bundles, --no-warm-up": (serve(bundles, None, "--no-warm-up"), {}, n),
        },
    )


def vllm(ctx: Context, bundles: Path, empty: Path, openblas: str | None) -> dict[str, Any]:
    """vllm-mlx: plain as installed, plain with OpenBLAS, serve with no bundle, with bundles (the
    warm-up on and off)."""
    plain = [str(VENV / "bin" / "python"), "-m", "vllm_mlx.cli", "serve", str(MODEL)]
    # --quick leaves out the run on mlx's own BLAS: 146 s of the 11k-token prefill alone (measured)
    as_installed = {} if ctx.quick else {"cold, as installed": (plain, {}, 1)}
    return measure(
        ctx,
        "vllm-mlx",
        {
            **as_installed,
            "cold, OpenBLAS preloaded": (plain, {"LD_PRELOAD": openblas} if openblas else {}, 1),
            "cold, serve --server vllm-mlx with no bundle": (serve(empty, "vllm-mlx"), {}, 1),
            "bundles (serve --server vllm-mlx)": (
                serve(bundles, "vllm-mlx"),
                {},
                1 if ctx.quick else 3,
            ),
            "bundles, --no-warm-up": (
                serve(bundles, "vllm-mlx", "--no-warm-up"),
                {},
                1 if ctx.quick else 3,
            ),
        },
        kinds=("system", "anthropic"),
    )


def omni_bundles(ctx: Context) -> Path:
    """The support-agent prefix built through omni's own request code (servers =
    ["mlx-omni-server"]), in the server venv where omni is installed."""
    project = ctx.work / "omni-project"
    prefixes = project / "prefixes"
    if prefixes.exists():
        shutil.rmtree(prefixes)
    shutil.copytree(REPO / "prefixes" / "support-agent", prefixes / "support-agent")
    text = (REPO / "prefixes" / "support-agent.toml").read_text()
    text = text.replace("[template]", 'servers = ["mlx-omni-server"]\n\n[template]', 1)
    text = text.replace('path = "models/demo-tiny"', f"path = {json.dumps(str(MODEL))}")
    (prefixes / "support-agent.toml").write_text(text)
    cli = [str(VENV / "bin" / "python"), str(REPO / "build.py"), "--prefixes", str(prefixes)]
    subprocess.run(
        [*cli, "--bundles", str(project / "bundles"), "build", "--no-check", "support-agent"],
        check=True,
        cwd=project,
        env=clean_env(),
        capture_output=True,
    )
    return project / "bundles"


def omni(ctx: Context, bundles: Path, empty: Path) -> dict[str, Any]:
    """omni's chat route (tests/envs/omni_chat_app.py: its full app needs mflux) with serve's
    preparation, no bundle vs bundles built from the builder's rendering vs bundles built through
    omni's own request code; OpenBLAS in all."""
    own = omni_bundles(ctx)
    app = [str(VENV / "bin" / "python"), str(REPO / "tests" / "envs" / "omni_chat_app.py")]

    def cmd(folder: Path, *options: str) -> list[str]:
        # the app takes PORT first: measure() appends --port P, so it is passed as an option here
        return [
            *app,
            "--bundles",
            str(folder),
            "serve",
            *options,
            "--server",
            "mlx-omni-server",
            "--model",
            str(MODEL),
        ]

    return measure(
        ctx,
        "mlx-omni-server",
        {
            **({} if ctx.quick else {"cold (no bundle), OpenBLAS": (cmd(empty), {}, 1)}),
            "bundles (serve --server mlx-omni-server)": (cmd(bundles), {}, 1 if ctx.quick else 3),
            "bundles built with servers = [mlx-omni-server]": (
                cmd(own),
                {},
                1 if ctx.quick else 3,
            ),
            "the same, --no-warm-up": (cmd(own, "--no-warm-up"), {}, 1 if ctx.quick else 3),
        },
    )


def batching(ctx: Context, bundles: Path, empty: Path, openblas: str | None) -> dict[str, Any]:
    """vllm-mlx --continuous-batching (BatchedEngine): plain with OpenBLAS, and with bundles."""
    plain = [str(VENV / "bin" / "python"), "-m", "vllm_mlx.cli", "serve", str(MODEL)]
    batched = ["--continuous-batching"]
    return measure(
        ctx,
        "vllm-mlx --continuous-batching",
        {
            "cold, OpenBLAS preloaded": (
                [*plain, *batched],
                {"LD_PRELOAD": openblas} if openblas else {},
                1,
            ),
            "bundles (serve --server vllm-mlx --continuous-batching)": (
                [*serve(bundles, "vllm-mlx"), *batched],
                {},
                1 if ctx.quick else 3,
            ),
            "bundles, --no-warm-up": (
                [*serve(bundles, "vllm-mlx", "--no-warm-up"), *batched],
                {},
                1 if ctx.quick else 3,
            ),
        },
    )


def rapid(ctx: Context, bundles: Path, openblas: str | None) -> dict[str, Any]:
    """rapid-mlx (its own venv, tests/envs/make_rapid_env.sh): plain `rapid-mlx serve` with
    OpenBLAS, and with bundles (serve --server rapid-mlx)."""
    python = str(RAPID_VENV / "bin" / "python")
    plain = [python, "-m", "rapid_mlx.cli", "serve", str(MODEL)]
    with_bundles = [python, str(REPO / "build.py"), "--bundles", str(bundles), "serve"]
    named = ["--server", "rapid-mlx", "--model", str(MODEL)]
    return measure(
        ctx,
        "rapid-mlx",
        {
            "cold, OpenBLAS preloaded": (plain, {"LD_PRELOAD": openblas} if openblas else {}, 1),
            "bundles (serve --server rapid-mlx)": (
                [*with_bundles, *named],
                {},
                1 if ctx.quick else 3,
            ),
            "bundles, --no-warm-up": (
                [*with_bundles, "--no-warm-up", *named],
                {},
                1 if ctx.quick else 3,
            ),
        },
        kinds=("system", "anthropic"),
    )


def openai(ctx: Context, bundles: Path, empty: Path) -> dict[str, Any]:
    """mlx-openai-server as a real server: no bundle vs bundles, both through serve (OpenBLAS)."""
    return measure(
        ctx,
        "mlx-openai-server",
        {
            **(
                {}
                if ctx.quick  # --quick: the bundle rows only (one cold row, vllm-mlx's, remains)
                else {"cold (no bundle), OpenBLAS": (serve(empty, "mlx-openai-server"), {}, 1)}
            ),
            "bundles (serve --server mlx-openai-server)": (
                serve(bundles, "mlx-openai-server"),
                {},
                1 if ctx.quick else 3,
            ),
            "bundles, --no-warm-up": (
                serve(bundles, "mlx-openai-server", "--no-warm-up"),
                {},
                1 if ctx.quick else 3,
            ),
        },
    )


def demo_bundles(ctx: Context) -> Path:
    """The demo's bundles (`build.py demo`: the demo model and its prefixes) under WORK."""
    bundles = ctx.work / "servers-bundles"
    bundles.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, str(REPO / "build.py"), "--bundles", str(bundles), "demo"],
        check=True,
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
    )
    return bundles


def run(ctx: Context) -> dict[str, Any] | None:
    """Demo model and bundles (under WORK), then each server's rows."""
    from pipeline.blas import blas_status

    if not (VENV / "bin" / "python").exists():
        ctx.note(f"servers: skipped, no server venv at {VENV} (tests/envs/make_servers_env.sh)")
        return None
    bundles = demo_bundles(ctx)
    empty = ctx.work / "servers-none"
    empty.mkdir(exist_ok=True)
    only = os.environ.get(
        "BENCH_SERVERS",
        "mlx_lm.server,vllm-mlx,vllm-mlx-batched,mlx-omni-server,mlx-openai-server,rapid-mlx",
    ).split(",")
    result = {}
    if "mlx_lm.server" in only:
        result["mlx_lm.server"] = mlx_lm(ctx, bundles, empty, blas_status().library)
    if "vllm-mlx" in only:
        result["vllm-mlx"] = vllm(ctx, bundles, empty, blas_status().library)
    if "vllm-mlx-batched" in only:
        result["vllm-mlx --continuous-batching"] = batching(
            ctx, bundles, empty, blas_status().library
        )
    if "rapid-mlx" in only and (RAPID_VENV / "bin" / "python").exists():
        result["rapid-mlx"] = rapid(ctx, bundles, blas_status().library)
    if "mlx-omni-server" in only:
        result["mlx-omni-server"] = omni(ctx, bundles, empty)
    if "mlx-openai-server" in only:
        result["mlx-openai-server"] = openai(ctx, bundles, empty)
    return result


def section(result: dict[str, Any]) -> list[str]:
    """Markdown for RESULTS.md."""
    lines = [
        "## Servers: first request with bundles vs the same server cold, and vs its in-memory hit",
        "",
        "Demo model `models/demo-tiny`, support-agent prefix (11,052 tokens) plus one question, "
        "8 tokens at temperature 0; a fresh server per run: its first request after startup, the "
        "next question on the same prefix (the in-memory hit: what a warm server costs a new "
        "client), the first request again (repeat: its whole prompt is in memory, which no "
        "prefix cache gives a new question), then in the same process the request without "
        "the tools (system only) and, on vllm-mlx, the request as Anthropic /v1/messages. "
        "'cached' is what the server's usage reports (cached_tokens / cache_read_input_tokens). "
        "Server venv (tests/envs/make_servers_env.sh): mlx-lm 0.31.3, vllm-mlx 0.6.0, "
        "mlx-omni-server 0.5.3, mlx-openai-server 1.8.1.",
        "",
        "| server | run | first request s | hit s | first / hit | repeat s | startup s | cached "
        "| system only: s, cached | Anthropic: s, cached | answer |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for server, rows in result.items():
        for label, row in rows.items():
            first, hit = row["first_s"], row["hit_s"]
            cell = f"{first['median']:.2f}" + (
                f" ({first['min']:.2f}–{first['max']:.2f}, n={first['n']})"
                if first["n"] > 1
                else ""
            )
            answers = " / ".join(repr(a) for a in row["answers"])
            kinds = [_kind(row.get(kind)) for kind in ("system", "anthropic")]
            lines.append(
                f"| {server} | {label} | {cell} | {hit['median']:.2f} | "
                f"{ratio(first['median'], hit['median']):.2f}x | {row['repeat_s']['median']:.2f} "
                f"| {row['startup_s']['median']:.1f} "
                f"| {_cached(row['cached'])} | {kinds[0]} | {kinds[1]} | {answers} |"
            )
        lines += _speedups(server, rows)
    return [*lines, ""]


def _cached(values: list) -> str:
    return "/".join("-" if v is None else f"{v:,}" for v in values)


def _kind(row: dict[str, Any] | None) -> str:
    return "" if row is None else f"{row['s']['median']:.2f}, {_cached(row['cached'])}"


def _speedups(server: str, rows: dict[str, Any]) -> list[str]:
    """One line: how many times faster the first request is with bundles than each cold run."""
    warm = next(row for label, row in rows.items() if label.startswith("bundles"))
    parts = [
        f"{ratio(row['first_s']['median'], warm['first_s']['median']):.1f}x vs {label}"
        for label, row in rows.items()
        if label.startswith("cold")
    ]
    same = len({a for row in rows.values() for a in row["answers"]}) == 1
    return [f"| {server} | speed-up | {', '.join(parts)} | | | | | | | | same answer: {same} |"]


if __name__ == "__main__":
    standalone("servers", run, section)
