"""Case servers: each non-default server's first request with bundles (`serve --server NAME`) vs the
same server's first request cold, on the demo's support-agent prefix (11,052 tokens), same answer.

Runs in the server venv (tests/envs/make_servers_env.sh; vllm-mlx, omni and mlx-openai-server pin
mlx-lm 0.31). vllm-mlx is measured as a real server over loopback HTTP: plain `vllm-mlx serve` as
installed (mlx's own BLAS), plain with OpenBLAS preloaded (what `serve` loads), and `serve --server
vllm-mlx`. Standalone: `python bench/case_servers.py [--quick]` prints the markdown section.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent)]

from common import REPO, Context, clean_env, ratio, stat  # noqa: E402

MODEL = REPO / "models" / "demo-tiny"
VENV = Path(os.environ.get("PREFIX_BUNDLES_SERVERS_VENV", REPO / ".venv-servers"))
PREFIX = REPO / "prefixes" / "support-agent"
QUESTION = "My 2FA codes stopped working after I changed phones. How do I get back in?"


def request_body() -> dict[str, Any]:
    """The support-agent prefix (system text + 8 tools) and one question, temperature 0."""
    return {
        "model": str(MODEL),
        "messages": [
            {"role": "system", "content": (PREFIX / "system.md").read_text()},
            {"role": "user", "content": QUESTION},
        ],
        "tools": json.loads((PREFIX / "tools.json").read_text()),
        "max_tokens": 8,
        "temperature": 0.0,
    }


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(port: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("server not ready")


def first_request(args: list[str], port: int, log: Path, env: dict[str, str]) -> dict[str, Any]:
    """Start a server, time startup and its first chat request, stop it by its pid."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        try:
            _ready(port, proc)
            ready = time.perf_counter() - start
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                data=json.dumps(request_body()).encode(),
                headers={"Content-Type": "application/json"},
            )
            t = time.perf_counter()
            with urllib.request.urlopen(req, timeout=1800) as resp:
                answer = json.loads(resp.read())
            seconds = time.perf_counter() - t
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    message = answer["choices"][0]["message"]
    return {"startup_s": ready, "first_s": seconds, "answer": message.get("content")}


def measure(ctx: Context, server: str, runs: dict[str, tuple]) -> dict[str, Any]:
    """{label: (command line without --port, extra env, repetitions)} -> rows of first requests."""
    rows = {}
    for label, (cmd, env, n) in runs.items():
        got = []
        for i in range(n):
            port = _port()
            log = ctx.work / f"{server}-{len(rows)}-{i}.log"
            got.append(first_request([*cmd, "--port", str(port)], port, log, clean_env(**env)))
            ctx.note(f"servers: {server} {label}: first request {got[-1]['first_s']:.2f} s")
        rows[label] = {
            "first_s": stat([g["first_s"] for g in got]).as_dict(),
            "startup_s": stat([g["startup_s"] for g in got]).as_dict(),
            "answers": sorted({g["answer"] for g in got}),
        }
    return rows


def serve(bundles: Path, server: str) -> list[str]:
    """`build.py serve --server NAME` in the server venv."""
    python = str(VENV / "bin" / "python")
    return [python, str(REPO / "build.py"), "--bundles", str(bundles), "serve"] + [
        "--server",
        server,
        "--model",
        str(MODEL),
    ]


def vllm(ctx: Context, bundles: Path, openblas: str | None) -> dict[str, Any]:
    """vllm-mlx: plain as installed, plain with OpenBLAS, and with bundles (serve --server)."""
    plain = [str(VENV / "bin" / "python"), "-m", "vllm_mlx.cli", "serve", str(MODEL)]
    # --quick leaves out the run on mlx's own BLAS: 146 s of the 11k-token prefill alone (measured)
    as_installed = {} if ctx.quick else {"cold, as installed": (plain, {}, 1)}
    return measure(
        ctx,
        "vllm-mlx",
        {
            **as_installed,
            "cold, OpenBLAS preloaded": (plain, {"LD_PRELOAD": openblas} if openblas else {}, 1),
            "bundles (serve --server vllm-mlx)": (
                serve(bundles, "vllm-mlx"),
                {},
                1 if ctx.quick else 3,
            ),
        },
    )


def omni(ctx: Context, bundles: Path, empty: Path) -> dict[str, Any]:
    """omni's chat route (tests/envs/omni_chat_app.py: its full app needs mflux) with serve's
    preparation, no bundle vs bundles; OpenBLAS in both."""
    app = [str(VENV / "bin" / "python"), str(REPO / "tests" / "envs" / "omni_chat_app.py")]

    def cmd(folder: Path) -> list[str]:
        # the app takes PORT first: measure() appends --port P, so it is passed as an option here
        return [
            *app,
            "--bundles",
            str(folder),
            "serve",
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
        },
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
        },
    )


def run(ctx: Context) -> dict[str, Any] | None:
    """Demo model and bundles (under WORK), then each server's rows."""
    from pipeline.blas import blas_status

    if not (VENV / "bin" / "python").exists():
        ctx.note(f"servers: skipped, no server venv at {VENV} (tests/envs/make_servers_env.sh)")
        return None
    bundles = ctx.work / "servers-bundles"
    bundles.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, str(REPO / "build.py"), "--bundles", str(bundles), "demo"],
        check=True,
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
    )
    empty = ctx.work / "servers-none"
    empty.mkdir(exist_ok=True)
    only = os.environ.get("BENCH_SERVERS", "vllm-mlx,mlx-omni-server,mlx-openai-server")
    result = {}
    if "vllm-mlx" in only:
        result["vllm-mlx"] = vllm(ctx, bundles, blas_status().library)
    if "mlx-omni-server" in only:
        result["mlx-omni-server"] = omni(ctx, bundles, empty)
    if "mlx-openai-server" in only:
        result["mlx-openai-server"] = openai(ctx, bundles, empty)
    return result


def section(result: dict[str, Any]) -> list[str]:
    """Markdown for RESULTS.md."""
    lines = [
        "## Servers: first request with bundles vs the same server cold",
        "",
        "Demo model `models/demo-tiny`, support-agent prefix (11,052 tokens) plus one question, "
        "8 tokens at temperature 0; a fresh server per run (first request after startup). "
        "Server venv (tests/envs/make_servers_env.sh): mlx-lm 0.31.3, vllm-mlx 0.6.0, "
        "mlx-omni-server 0.5.3, mlx-openai-server 1.8.1.",
        "",
        "| server | run | first request s | startup s | answer |",
        "| --- | --- | --- | --- | --- |",
    ]
    for server, rows in result.items():
        for label, row in rows.items():
            first, startup = row["first_s"], row["startup_s"]
            cell = f"{first['median']:.2f}" + (
                f" ({first['min']:.2f}–{first['max']:.2f}, n={first['n']})"
                if first["n"] > 1
                else ""
            )
            answers = " / ".join(repr(a) for a in row["answers"])
            lines.append(f"| {server} | {label} | {cell} | {startup['median']:.1f} | {answers} |")
        lines += _speedups(server, rows)
    return [*lines, ""]


def _speedups(server: str, rows: dict[str, Any]) -> list[str]:
    """One line: how many times faster the first request is with bundles than each cold run."""
    warm = next(row for label, row in rows.items() if label.startswith("bundles"))
    parts = [
        f"{ratio(row['first_s']['median'], warm['first_s']['median']):.1f}x vs {label}"
        for label, row in rows.items()
        if label.startswith("cold")
    ]
    same = len({a for row in rows.values() for a in row["answers"]}) == 1
    return [f"| {server} | speed-up | {', '.join(parts)} | | same answer: {same} |"]


if __name__ == "__main__":
    from pipeline.blas import ensure_fast_blas

    ensure_fast_blas(sys.argv[1:])
    work = REPO / "bench" / "out" / "servers"
    work.mkdir(parents=True, exist_ok=True)
    if "--render" not in sys.argv:  # --render: print the section of the last run's servers.json
        result = run(Context("--quick" in sys.argv, work))
        (work / "servers.json").write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(section(json.loads((work / "servers.json").read_text()))))
