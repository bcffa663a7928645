#!/usr/bin/env python3
"""`just bench [--quick] [--out DIR]`: benchmarks side by side with mlx_lm -> RESULTS.md, ttft.png."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent)]
if "--quick" in sys.argv[1:]:  # before the cases import common: the small model (common.MODEL_SIZE)
    os.environ.setdefault("PREFIX_BUNDLES_BENCH_SIZE", "small")

import case_arch  # noqa: E402
import case_build  # noqa: E402
import case_concurrency  # noqa: E402
import case_eta  # noqa: E402
import case_incremental  # noqa: E402
import case_mount  # noqa: E402
import case_oci  # noqa: E402
import case_servers  # noqa: E402
import case_sizes  # noqa: E402
import case_snapshots  # noqa: E402
import case_ttft  # noqa: E402
import chart  # noqa: E402
import report  # noqa: E402
import summary  # noqa: E402
from common import BENCH as BENCH_DIR  # noqa: E402
from common import HUGE_PAGES, MODEL_F32, Context, ensure_models, run_worker, stat  # noqa: E402

from pipeline.blas import blas_status, ensure_fast_blas  # noqa: E402

CASES = (
    "build", "ttft", "mount", "sizes", "incremental", "oci", "eta", "handout", "arch", "servers",
    "concurrency", "snapshots",
)  # fmt: skip
STEPS = (
    "setup",
    "calibration",
    "build",
    "ttft_bundles",
    "ttft",
    "mount",
    "sizes",
    "incremental",
    "oci",
    "eta",
    "handout",
    "arch",
    "servers",
    "concurrency",
    "snapshots",
)
BENCH_MODEL_CASES = {
    "build",
    "ttft",
    "mount",
    "sizes",
    "incremental",
    "oci",
    "eta",
    "snapshots",
}  # the ones that need models/bench-*


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/run.py", description=__doc__)
    p.add_argument(
        "--quick",
        action="store_true",
        help="every case on a 4-layer model, short prompts, one repetition: a smoke run "
        "(measured: 4.3 min on this 2-core VM, others' load ~1.5; its ratios are not the targets')",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=BENCH_DIR,
        help="where RESULTS.md and ttft.png go (default: bench/)",
    )
    p.add_argument(
        "--work", type=Path, default=BENCH_DIR / "out", help="scratch folder (default: bench/out/)"
    )
    p.add_argument(
        "--render",
        action="store_true",
        help="measure nothing: rewrite RESULTS.md and ttft.png from WORK/results.json",
    )
    p.add_argument(
        "--cases", default=",".join(CASES), help=f"comma list of {','.join(CASES)} (default: all)"
    )
    return p


def timed(ctx: Context, name: str, results: dict[str, Any], fn: Callable[[], Any]) -> Any:
    """Run one case; keep its duration, and its error instead of stopping the whole run."""
    start = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as exc:  # a failed case must not lose the others' measurements
        ctx.note(f"{name} FAILED: {exc}")
        results.setdefault("errors", {})[name] = "".join(
            traceback.format_exception_only(exc)
        ).strip()
        traceback.print_exc()
    results.setdefault("durations", {})[name] = time.perf_counter() - start
    return results.get(name)


def handout(quick: bool) -> dict[str, Any] | None:
    """bench/bench_handout.py, another engineer's hand-out benchmark, in its own process (hook)."""
    if not (BENCH_DIR / "bench_handout.py").is_file():
        return None
    r = run_worker("handout", {"quick": quick})
    # serve --huge-pages on; --quick leaves this rerun out (the report then omits its table)
    huge = None if quick else run_worker("handout", {"quick": quick}, **HUGE_PAGES)
    frozen = run_worker(
        "frozen_base", {"model": str(MODEL_F32), "tokens": 2048 if quick else 16384}
    )
    return {
        "result": r["result"],
        "markdown": r["markdown"],
        "seconds": r["process_seconds"],
        "hugepages": huge and {"result": huge["result"], "markdown": huge["markdown"]},
        "frozen_base": {"result": frozen["result"], "markdown": frozen["markdown"]},
    }


def prime(ctx: Context) -> dict[str, Path]:
    """Models present and their weight hashes memoised (a server's steady state; stat-only after)."""
    from pipeline.format.fingerprint import model_identity

    models = ensure_models()
    for path in models.values():
        model_identity(path)
    ctx.note(f"models ready: {', '.join(str(p) for p in models.values())}")
    return {k: str(v) for k, v in models.items()}


def calibrate(ctx: Context) -> dict[str, Any]:
    """Cost of a first touch of fresh memory on this machine (it dominates big loads in VMs)."""
    got = [run_worker("touch", {"mib": 1024}) for _ in range(1 if ctx.quick else 3)]
    ctx.note(f"first touch of fresh memory: {[round(g['us_per_page'], 2) for g in got]} us/page")
    return {"us_per_page": stat([g["us_per_page"] for g in got]).as_dict()}


def run_all(ctx: Context, cases: set[str]) -> dict[str, Any]:
    """Every selected case, in an order that lets later cases reuse earlier bundles."""
    results: dict[str, Any] = {"quick": ctx.quick, "cases": sorted(cases)}
    openblas = blas_status().library  # the OpenBLAS that workers load
    results["openblas"] = openblas
    if cases & BENCH_MODEL_CASES:  # 3.6 GB generated on first use: not for arch/handout alone
        timed(ctx, "setup", results, lambda: prime(ctx))
    timed(ctx, "calibration", results, lambda: calibrate(ctx))
    if "build" in cases:
        timed(ctx, "build", results, lambda: case_build.run(ctx, openblas))
    bundles: list[dict[str, Any]] = []
    if cases & {"ttft", "mount"}:
        bundles = timed(ctx, "ttft_bundles", results, lambda: case_ttft.build_bundles(ctx)) or []
    if "ttft" in cases and bundles:
        timed(ctx, "ttft", results, lambda: case_ttft.run(ctx, bundles))
    if "mount" in cases and bundles:
        timed(ctx, "mount", results, lambda: case_mount.run(ctx, bundles[-1]))
    if "sizes" in cases:
        timed(ctx, "sizes", results, lambda: case_sizes.run(ctx))
    if "incremental" in cases:
        timed(ctx, "incremental", results, lambda: case_incremental.run(ctx))
    if "oci" in cases:  # needs /usr/bin/docker-registry and curl
        timed(ctx, "oci", results, lambda: case_oci.run(ctx))
    if "eta" in cases:
        timed(ctx, "eta", results, lambda: case_eta.run(ctx))
    results["memory"] = summary.memory(bundles, results.get("sizes"), results.get("mount"))
    if "handout" in cases:
        timed(ctx, "handout", results, lambda: handout(ctx.quick))
    if "arch" in cases:
        timed(ctx, "arch", results, lambda: case_arch.run(ctx))
        for row in (results.get("arch") or {}).get("rows", []):
            if "error" in row:  # a broken architecture fails the run, as a failed case does
                results.setdefault("errors", {})[f"arch {row['arch']}"] = row["error"]
    if "servers" in cases:  # needs the server venv (tests/envs/make_servers_env.sh)
        timed(ctx, "servers", results, lambda: case_servers.run(ctx))
    if "concurrency" in cases:  # the batched engines, in the server venvs
        timed(ctx, "concurrency", results, lambda: case_concurrency.run(ctx))
    if "snapshots" in cases:  # mlx_lm.server in this venv, restarted with and without snapshots
        timed(ctx, "snapshots", results, lambda: case_snapshots.run(ctx))
    results["targets"] = summary.targets(results, ctx.quick)
    return results


def markdown(results: dict[str, Any], total: float) -> str:
    """The whole RESULTS.md."""
    mode = (
        "QUICK (`--quick`: a 4-layer model, shorter prompts and prefixes, one repetition)"
        if results["quick"]
        else "FULL"
    )
    lines = [
        "# Benchmark results",
        "",
        f"Generated by `python bench/run.py{' --quick' if results['quick'] else ''}` on "
        f"{results.get('finished_at', '?')}; mode: **{mode}**; total {total / 60:.1f} min.",
        "Every figure below comes from this one run: medians over repetitions, min–max in brackets, "
        "n = repetitions, ratios of medians taken side by side. Bench model: Qwen3-0.6B shapes, random "
        "weights (`pipeline.testmodels.model`), as shipped in bfloat16 plus a float32 variant; the dtype is "
        "named in every section.",
        "",
    ]
    found = results.get("machine") or report.machine(results["openblas"])
    info = {k: found[k] for k in report.MACHINE_KEYS if k in found}
    if results.get("calibration"):
        us = report.cell(results["calibration"]["us_per_page"], "{:.2f}")
        n = results["calibration"]["us_per_page"]["n"]
        info["first touch of fresh memory"] = (
            f"{us} µs per 4 KiB page (1 GiB, fresh process, n={n})"
        )
    lines += report.table(["machine", ""], [[k, v] for k, v in info.items()])
    if results["targets"]:  # none when only arch/handout ran
        lines += report.targets_section(results["targets"])
        lines += [
            "Why the missed targets are missed (measured, with what stands in the way and the change "
            "that would fix it): `bench/README.md`, section *Findings*.",
            "",
        ]
    sections = [
        ("build", lambda r: report.build_section(r)),
        ("ttft", lambda r: report.ttft_section(r, results.get("ttft_bundles") or [])),
        ("mount", report.mount_section),
        ("sizes", report.sizes_section),
    ]
    for key, render in sections:
        if results.get(key):
            lines += render(results[key])
    if results["memory"]["rows"]:
        lines += report.memory_section(results["memory"])
    if results.get("incremental"):
        lines += case_incremental.section(results["incremental"])
    if results.get("oci"):
        lines += case_oci.section(results["oci"])
    if results.get("eta"):
        lines += case_eta.section(results["eta"])

    if "handout" in results.get("cases", []):
        lines += report.handout_section(results.get("handout"))
    if results.get("arch"):
        lines += report.arch_section(results["arch"])
    if results.get("servers"):
        lines += case_servers.section(results["servers"])
    if results.get("concurrency"):
        lines += case_concurrency.section(results["concurrency"])
    if results.get("snapshots"):
        lines += case_snapshots.section(results["snapshots"])
    for name, err in results.get("errors", {}).items():
        lines += [f"**Case {name} failed:** `{err}`", ""]
    spent = results.get("durations", {})
    durations = ", ".join(f"{k} {spent[k]:.0f}s" for k in STEPS if k in spent)
    lines += [f"Case durations: {durations}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    blas = ensure_fast_blas(sys.argv[1:] if argv is None else argv)
    args = setup_arg_parser().parse_args(argv)
    if args.render:
        return render(json.loads((args.work / "results.json").read_text()), args.out)
    cases = {c.strip() for c in args.cases.split(",") if c.strip()}
    unknown = cases - set(CASES)
    if unknown:
        print(
            f"error: unknown case(s) {', '.join(sorted(unknown))}; choose from {', '.join(CASES)}",
            file=sys.stderr,
        )
        return 2
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Context(args.quick, args.work.resolve())
    ctx.note(blas.notice)
    start = time.perf_counter()
    results = run_all(ctx, cases)
    total = time.perf_counter() - start
    results["total_seconds"] = total
    results["finished_at"] = time.strftime("%Y-%m-%d %H:%M")
    results["machine"] = report.machine(results["openblas"])
    (args.work / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    render(results, args.out)
    ctx.note(f"wrote {args.out / 'RESULTS.md'} in {total / 60:.1f} min")
    return 1 if results.get("errors") else 0


def render(results: dict[str, Any], out: Path) -> int:
    """RESULTS.md and ttft.png from a results dict (as stored in results.json)."""
    out.mkdir(parents=True, exist_ok=True)
    results["targets"] = summary.targets(results, results["quick"])  # the current definitions
    (out / "RESULTS.md").write_text(markdown(results, results["total_seconds"]))
    if results.get("ttft"):
        chart.draw(results["ttft"], out / "ttft.png", results["quick"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
