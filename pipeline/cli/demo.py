"""`demo` and `demo-model`: the built-in demo job on a generated model."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from pipeline.cli.common import add_json_option, emit, progress, say

DEMO_MODEL = Path("models/demo-tiny")


def add_parser(sub: argparse._SubParsersAction, parents: list) -> None:
    m = sub.add_parser(  # reads neither --prefixes nor --bundles: its help has neither
        "demo-model", help="generate the deterministic demo/test model folder"
    )
    m.add_argument("--size", choices=("tiny", "bench"), default="tiny", help="model size")
    m.add_argument("--seed", type=int, default=0, help="weights seed")
    m.add_argument("--out", type=Path, default=DEMO_MODEL, help="folder to write")
    m.set_defaults(func=run_demo_model)
    d = sub.add_parser(
        "demo",
        parents=parents,
        help="generate the demo model, build, verify and mount every example",
    )
    add_json_option(d, "demo")
    d.set_defaults(func=run)


def run_demo_model(args: argparse.Namespace) -> int:
    from pipeline.testmodels.model import generate_model

    say(str(generate_model(args.out, args.size, seed=args.seed)))
    return 0


def run(args: argparse.Namespace) -> int:
    from pipeline.builder.demo import run_demo
    from pipeline.cli.eta import crossover_for_model

    crossover = crossover_for_model(DEMO_MODEL)  # the ETA's cost prior
    rows = run_demo(
        args.prefixes, args.bundles, DEMO_MODEL, progress=lambda label: progress(label, crossover)
    )
    emit(args, _report(args, rows), _print)
    return 0


def _report(args: argparse.Namespace, rows: list[dict]):
    from pipeline.cli.reports import DemoBundle, DemoReport

    bundles = [
        DemoBundle(
            prefix=r["prefix"], status=r["status"], tokens=r["tokens"], bytes=r["bytes"],
            prefill_seconds=None if math.isnan(r["prefill_s"]) else r["prefill_s"],
            build_seconds=None if math.isnan(r["build_s"]) else r["build_s"],
            mount_ms=r["mount_ms"],
        )
        for r in rows
    ]  # fmt: skip
    return DemoReport(model=str(DEMO_MODEL), bundles_dir=str(args.bundles), bundles=bundles)


def _print(report) -> None:
    header = (
        f"{'prefix':<22}{'tokens':>8}{'bytes':>13}{'build s':>9}{'prefill s':>11}{'mount ms':>10}"
        "  status"
    )
    say(header)
    say("-" * len(header))
    for r in report.bundles:
        build = f"{r.build_seconds:>9.1f}" if r.build_seconds is not None else f"{'-':>9}"
        prefill = f"{r.prefill_seconds:>11.3f}" if r.prefill_seconds is not None else f"{'-':>11}"
        say(
            f"{r.prefix:<22}{r.tokens:>8}{r.bytes:>13,}{build}{prefill}"
            f"{r.mount_ms:>10.1f}  {r.status}, verified, mounted"
        )
