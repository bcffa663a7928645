"""Case servers: each server of the registry (pipeline.runtime.servers.registry: the servers
`serve --server NAME` wraps) on the demo's support-agent prefix (11,052 tokens; --quick: shortened,
about 2,000, serving.QUICK_SYSTEM_CHARS and QUICK_TOOLS): its first request
with bundles vs the same server run plainly (the command its hook declares, `plain`) and vs its
in-memory hit (the next question on the same prefix), same answer; then, in the same process, the
request with the system prompt only (no tools: it shares part of the bundle) and, where the server
serves Anthropic messages (`messages_route`), the same prefix as an Anthropic /v1/messages request,
with the tokens each reused (the server's usage fields).

Each server runs in the venv holding its pinned distribution (tests/envs/make_servers_env.sh,
make_rapid_env.sh), as a real server over loopback HTTP. Full run per server: plain with OpenBLAS
preloaded (what `serve` loads), serve with no bundle, with bundles (n=3), with bundles and
--no-warm-up (n=3), and the engines of ENGINES the same way; vllm-mlx also plain as installed (mlx's
own BLAS), omni also on bundles built through its own request code. --quick, a smoke of the same
path: one server per registry entry, with bundles (n=1), and the default server (the registry's
first) plain beside it. Standalone: `python bench/case_servers.py [--quick]` prints the section.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent)]

import serving  # noqa: E402
from common import (  # noqa: E402
    REPO,
    Context,
    clean_env,
    each,
    free_port,
    post_json,
    ratio,
    standalone,
    stat,
    wait_ready,
)
from serving import MODEL, PREFIX, RAPID_VENV, VENV, request_body  # noqa: E402, F401

# the engines a server runs besides its default one, measured as rows of their own (full runs;
# case concurrency runs the batched engines in --quick): {server: {row name: server options}}
ENGINES = {"vllm-mlx": {"vllm-mlx --continuous-batching": ("--continuous-batching",)}}
AS_INSTALLED = ("vllm-mlx",)  # also run plainly on mlx's own BLAS (146 s of 11k prefill: full only)
OWN_REQUEST_BUILD = ("mlx-omni-server",)  # also on bundles built with servers = [NAME]


def _post(port: int, kind: str, quick: bool) -> tuple[float, str | None, int | None]:
    """(seconds, answer, cached tokens the usage reports) of one request."""
    route = "/v1/messages" if kind == "anthropic" else "/v1/chat/completions"
    seconds, answer = post_json(port, route, request_body(kind, quick))
    usage = answer.get("usage") or {}
    if kind == "anthropic":
        text = "".join(b.get("text") or "" for b in answer.get("content") or [])
        return seconds, text, usage.get("cache_read_input_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return seconds, answer["choices"][0]["message"].get("content"), cached


def first_request(
    args: list[str],
    port: int,
    log: Path,
    env: dict[str, str],
    kinds: tuple[str, ...],
    quick: bool = False,
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
            first, answer, cached = _post(port, "full", quick)
            hit = _post(port, "next", quick)[0]
            repeat = _post(port, "full", quick)[0]
            others = {kind: _post(port, kind, quick) for kind in kinds}
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
            home = ctx.work / f"home-{log.stem}"  # one per run: --quick runs two servers at once
            shutil.rmtree(home, ignore_errors=True)
            home.mkdir()
            env = {"HOME": str(home), **env}
            try:
                got.append(first_request(args, port, log, clean_env(**env), kinds, ctx.quick))
            except Exception as exc:  # the server's own words: the end of its log
                tail = log.read_text(errors="replace").strip().splitlines()[-5:]
                raise RuntimeError(f"{server} {label}: {exc}; its log ends: {tail}") from exc
            ctx.note(
                f"servers: {server} {label}: first request {got[-1]['first_s']:.2f} s, "
                f"hit {got[-1]['hit_s']:.2f} s, repeat {got[-1]['repeat_s']:.2f} s, "
                f"cached {got[-1]['cached']}"
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


def omni_bundles(ctx: Context, venv: Path) -> Path:
    """The support-agent prefix built through omni's own request code (servers =
    ["mlx-omni-server"]), in the venv where omni is installed."""
    project = serving.demo_project(ctx, "omni-project")
    (project / "prefixes" / "prefixes.lock").unlink()  # it pins the definition without servers
    toml = project / "prefixes" / f"{PREFIX.name}.toml"
    text = toml.read_text()
    toml.write_text(text.replace("[template]", 'servers = ["mlx-omni-server"]\n\n[template]', 1))
    return serving.build(project, str(venv / "bin" / "python"), "--no-check")


def runs_of(
    ctx: Context, server: str, venv: Path, bundles: Path, default: bool, *options: str
) -> dict[str, tuple]:
    """The runs of one server (with its engine `options`): {label: (command, env, n)}."""
    from pipeline.blas import blas_status

    openblas = blas_status().library
    preload = {"LD_PRELOAD": openblas} if openblas else {}
    own = serving.plain(server, venv)
    n = 1 if ctx.quick else 3
    runs: dict[str, tuple] = {}
    if own is not None and not ctx.quick and server in AS_INSTALLED and not options:
        runs["cold, plain as installed"] = ([*own, *options], {}, 1)
    if own is not None and (default or not ctx.quick):
        runs["cold, plain, OpenBLAS preloaded"] = ([*own, *options], preload, 1)
    if not ctx.quick:
        empty = ctx.work / "servers-none"
        empty.mkdir(exist_ok=True)
        runs["cold, serve with no bundle"] = (serving.serve(server, venv, empty, *options), {}, 1)
    runs["bundles (serve)"] = (serving.serve(server, venv, bundles, *options), {}, n)
    if not ctx.quick:
        no_warm_up = serving.serve(server, venv, bundles, "--no-warm-up", *options)
        runs["bundles, --no-warm-up"] = (no_warm_up, {}, n)
        if server in OWN_REQUEST_BUILD:
            own_bundles = omni_bundles(ctx, venv)
            runs[f"bundles built with servers = [{server}]"] = (
                serving.serve(server, venv, own_bundles, *options),
                {},
                n,
            )
    return runs


def run(ctx: Context, bundles: str) -> dict[str, Any]:
    """Each server of the registry (and its other engines, full runs) whose venv is made here;
    --quick, a smoke, starts two servers at a time (its figures are not compared across runs)."""
    from pipeline.runtime.servers.registry import hook_class, names

    jobs = {}
    for i, server in enumerate(names()):
        venv = serving.venv_of(server)
        if venv is None:
            ctx.note(f"servers: {server} skipped: no venv holds {hook_class(server).distribution}")
            continue
        kinds = ("system", "anthropic") if hook_class(server).messages_route else ("system",)
        engines = {server: ()} | ({} if ctx.quick else ENGINES.get(server, {}))
        for row, options in engines.items():
            runs = runs_of(ctx, server, venv, Path(bundles), i == 0, *options)
            jobs[row] = lambda row=row, runs=runs, kinds=kinds: measure(ctx, row, runs, kinds)
    result = {}
    for row, (got, exc) in each(2 if ctx.quick else 1, jobs).items():
        if exc is not None:
            raise exc
        result[row] = got
    return result


def section(result: dict[str, Any]) -> list[str]:
    """Markdown for RESULTS.md."""
    lines = [
        "## Servers: first request with bundles vs the same server cold, and vs its in-memory hit",
        "",
        "Demo model `models/demo-tiny`, support-agent prefix (11,052 tokens; a --quick run: "
        "shortened to about 2,000, the cached column says) plus one question, "
        "8 tokens at temperature 0; a fresh server per run: its first request after startup, the "
        "next question on the same prefix (the in-memory hit: what a warm server costs a new "
        "client), the first request again (repeat: its whole prompt is in memory, which no "
        "prefix cache gives a new question), then in the same process the request without "
        "the tools (system only) and, where the server serves it, the request as Anthropic "
        "/v1/messages. Servers: the registry's (pipeline.runtime.servers.registry); 'plain': the "
        "command its hook declares. "
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
    standalone("servers", lambda ctx: run(ctx, serving.bundles(ctx)), section)
