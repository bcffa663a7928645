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

import cases as registry  # noqa: E402  (bench/cases.py: the one registry)
import chart  # noqa: E402
import report  # noqa: E402
from common import BENCH as BENCH_DIR  # noqa: E402
from common import Context, ensure_models, run_worker, stat  # noqa: E402

from pipeline.blas import blas_status, ensure_fast_blas  # noqa: E402


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/run.py", description=__doc__)
    p.add_argument(
        "--quick",
        action="store_true",
        help="every case on a 4-layer model, short prompts, one repetition: a smoke run of each "
        "case's whole path (measured: 4.8 min in a clean clone on this 2-core VM beside other "
        "jobs, load ~5; its ratios are not the targets')",
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
        "--cases",
        default=",".join(registry.SELECTABLE),
        help=f"comma list of {','.join(registry.SELECTABLE)} (default: all)",
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
    mib = 256 if ctx.quick else 1024  # --quick: a smoke, a quarter of the pages
    got = [run_worker("touch", {"mib": mib}) for _ in range(1 if ctx.quick else 3)]
    ctx.note(f"first touch of fresh memory: {[round(g['us_per_page'], 2) for g in got]} us/page")
    return {"us_per_page": stat([g["us_per_page"] for g in got]).as_dict(), "mib": mib}


def run_all(ctx: Context, cases: set[str]) -> dict[str, Any]:
    """Every selected case (and what it needs), in the registry's order."""
    results: dict[str, Any] = {"quick": ctx.quick, "cases": sorted(cases)}
    results["openblas"] = blas_status().library  # the OpenBLAS that workers load
    steps = registry.chosen(cases)
    if any(case.bench_model for case in steps):  # 3.6 GB generated on first use
        timed(ctx, "setup", results, lambda: prime(ctx))
    timed(ctx, "calibration", results, lambda: calibrate(ctx))
    for case in steps:
        if all(results.get(need) for need in case.needs):  # a need that failed: said once
            timed(ctx, case.name, results, lambda case=case: case.run(ctx, results))
        for part, error in case.failures(results.get(case.name)).items():
            results.setdefault("errors", {})[part] = error
    results["targets"] = targets(results)
    return results


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every case's rows of the targets table, from its result."""
    rows: list[dict[str, Any]] = []
    for case in registry.REGISTRY:
        if case.targets is not None and results.get(case.name):
            rows += case.targets(results[case.name])
    return rows


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
            f"{us} µs per 4 KiB page ({results['calibration'].get('mib', 1024)} MiB, fresh "
            f"process, n={n})"
        )
    lines += report.table(["machine", ""], [[k, v] for k, v in info.items()])
    if results["targets"]:  # none when only arch/handout ran
        lines += report.targets_section(results["targets"])
        lines += [
            "Why the missed targets are missed (measured, with what stands in the way and the change "
            "that would fix it): `bench/README.md`, section *Findings*.",
            "",
        ]
    for case in registry.REGISTRY:
        said_absent = case.name == "handout" and "handout" in results["cases"]  # hook missing
        if case.section is not None and (results.get(case.name) or said_absent):
            lines += case.section(results.get(case.name), results)
    for name, err in results.get("errors", {}).items():
        lines += [f"**Case {name} failed:** `{err}`", ""]
    spent = results.get("durations", {})
    durations = ", ".join(f"{k} {v:.0f}s" for k, v in spent.items())
    lines += [f"Case durations: {durations}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    blas = ensure_fast_blas(sys.argv[1:] if argv is None else argv)
    args = setup_arg_parser().parse_args(argv)
    if args.render:
        return render(json.loads((args.work / "results.json").read_text()), args.out)
    cases = {c.strip() for c in args.cases.split(",") if c.strip()}
    unknown = cases - set(registry.SELECTABLE)
    if unknown:
        named = ", ".join(registry.SELECTABLE)
        print(
            f"error: unknown case(s) {', '.join(sorted(unknown))}; choose from {named}",
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
    print(durations_table(results), file=sys.stderr)
    ctx.note(f"wrote {args.out / 'RESULTS.md'} in {total / 60:.1f} min")
    for name in results.get("errors", {}):
        ctx.note(f"FAILED: {name} (its error is in RESULTS.md and above)")
    return 1 if results.get("errors") else 0


def durations_table(results: dict[str, Any]) -> str:
    """Each step's wall time, in the order they ran, and the total (printed at the end of a run)."""
    spent = results.get("durations", {})
    failed = results.get("errors", {})
    width = max((len(name) for name in spent), default=5)
    lines = [f"{'case':<{width}}  seconds"]
    for name, seconds in spent.items():
        lines.append(f"{name:<{width}}  {seconds:7.1f}{'  FAILED' if name in failed else ''}")
    lines.append(f"{'total':<{width}}  {results['total_seconds']:7.1f}")
    return "\n".join(lines)


def render(results: dict[str, Any], out: Path) -> int:
    """RESULTS.md and ttft.png from a results dict (as stored in results.json)."""
    out.mkdir(parents=True, exist_ok=True)
    results["targets"] = targets(results)  # the current definitions
    (out / "RESULTS.md").write_text(markdown(results, results["total_seconds"]))
    if results.get("ttft"):
        chart.draw(results["ttft"], out / "ttft.png", results["quick"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
