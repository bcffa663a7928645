"""Case: how honest the build's ETA is, on the real command's progress lines.

Each build is `python build.py build NAME --no-check --force` in a fresh process, stderr read line
by line as it comes (a pipe: the plain progress lines, one per chunk at most every 0.5 s). For each
line that has an ETA, the actual remaining time is the time from that line to the last line (all
tokens in the cache); error = ETA / actual − 1 (+: the ETA said longer). Reported: the first ETA
(after the first chunk), and the first ETA at or past 25 % and 50 % of the tokens. "rate only" is
what the line's own rate gives (tokens left / tok/s so far): the ETA before the cost model.
Builds: the demo prefixes on the demo model, and the bench model at two lengths (chunks of 2,048;
--quick: support-agent, and the small model at one length).
The machine is shared: other work changing speed mid-build is in the figures, not modelled.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__" and "--quick" in sys.argv[1:]:  # as bench/run.py: before common
    os.environ.setdefault("PREFIX_BUNDLES_BENCH_SIZE", "small")

import serving  # noqa: E402
from common import (  # noqa: E402
    MODEL_BF16,
    REPO,
    Context,
    clean_env,
    text_with_tokens,
    write_definition,
)

LINE = re.compile(r"^(?P<label>.+?): prefill (?P<done>\d+)/(?P<total>\d+) tokens.*?, "
                  r"(?P<rate>[\d,.]+) tok/s, ETA (?P<eta>[\d.]+)s$")  # fmt: skip
DEMO_PREFIXES = ("docqa-handbook", "support-agent")
GOAL = 0.30  # |error| of the first ETA (issue 38)
SYSTEM = "You are the assistant of a field team. Answer from these notes only.\nNotes:\n"


def settings(quick: bool) -> dict[str, Any]:
    """The bench model's lengths (16k takes ~10+ min on 2 cores: full runs only; --quick: one)."""
    return {"lengths": [4096] if quick else [4096, 16384]}


def errors(lines: list[tuple[float, str]]) -> dict[str, Any]:
    """The ETA lines of one build (arrival time, text) against the time the last one came."""
    found = [(t, m) for t, text in lines if (m := LINE.match(text))]
    if not found:
        raise RuntimeError(f"no ETA line in {[text for _, text in lines][-5:]}")
    end = max(t for t, _ in found)  # the line with every token in the cache
    points = []
    for t, m in found:
        done, total, rest = int(m["done"]), int(m["total"]), end - t
        if done >= total or rest <= 0:
            continue
        rate_only = (total - done) / max(float(m["rate"].replace(",", "")), 1e-9)
        points.append(
            {"fraction": done / total, "eta": float(m["eta"]), "actual": rest,
             "error": float(m["eta"]) / rest - 1, "rate_only_error": rate_only / rest - 1}
        )  # fmt: skip
    return {"tokens": int(found[-1][1]["total"]), "points": points}


def at(points: list[dict[str, Any]], fraction: float) -> dict[str, Any] | None:
    """The first ETA at or past `fraction` of the tokens."""
    return next((p for p in points if p["fraction"] >= fraction), None)


def build_lines(project: Path, name: str) -> list[tuple[float, str]]:
    """The build's stderr lines with the time each arrived."""
    cmd = [sys.executable, str(REPO / "build.py"), "--prefixes", str(project / "prefixes")]
    cmd += ["--bundles", str(project / "bundles"), "build", name, "--no-check", "--force"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, bufsize=1,
        env=clean_env(), cwd=project,
    )  # fmt: skip
    lines = [(time.perf_counter(), line.rstrip("\n")) for line in proc.stderr]
    if proc.wait() != 0:
        raise RuntimeError(f"build {name} failed: {[text for _, text in lines][-3:]}")
    return lines


def bench_project(ctx: Context, tokens: int) -> Path:
    """One definition of about `tokens` tokens on the bench model."""
    project = ctx.work / "eta" / f"bench-{tokens}"
    shutil.rmtree(project, ignore_errors=True)
    text = SYSTEM + text_with_tokens(MODEL_BF16, tokens - 40, seed=21)
    write_definition(project, "notes", MODEL_BF16, [{"role": "system", "content": text}])
    return project


def run(ctx: Context) -> dict[str, Any]:
    """Every build's ETA errors."""
    rows = []
    demo = serving.demo_project(ctx, "eta/demo")
    # --quick: one demo prefix (the last) and one bench length, the whole path of a full run
    jobs = [("demo", demo, name) for name in (DEMO_PREFIXES[-1:] if ctx.quick else DEMO_PREFIXES)]
    jobs += [
        (MODEL_BF16.name, bench_project(ctx, n), "notes") for n in settings(ctx.quick)["lengths"]
    ]
    for model, project, name in jobs:
        ctx.note(f"eta: building {name} on {model}")
        r = errors(build_lines(project, name))
        first = r["points"][0] if r["points"] else None
        rows.append({"model": model, "prefix": name, **r, "first": first,
                     "at_25": at(r["points"], 0.25), "at_50": at(r["points"], 0.5)})  # fmt: skip
        if first:
            ctx.note(f"eta: {name} {r['tokens']} tokens: first ETA {first['eta']:.1f}s for "
                     f"{first['actual']:.1f}s ({first['error']:+.0%})")  # fmt: skip
    return {"rows": rows, "goal": GOAL}


def _cell(p: dict[str, Any] | None, key: str = "error") -> str:
    if p is None:
        return "–"
    return (
        f"{p[key]:+.0%} ({p['eta']:.1f} s for {p['actual']:.1f} s at {p['fraction']:.0%})"
        if key == "error"
        else f"{p[key]:+.0%}"
    )  # noqa: E501


def section(r: dict[str, Any]) -> list[str]:
    """The RESULTS.md section."""
    from report import heading, table

    lines = [
        *heading("ETA of a build (honest on long prefills)", __doc__),
    ]
    rows = [
        [x["model"], x["prefix"], f"{x['tokens']:,}", len(x["points"]), _cell(x["first"]),
         _cell(x["first"], "rate_only_error"), _cell(x["at_25"]), _cell(x["at_50"])]
        for x in r["rows"]
    ]  # fmt: skip
    header = ["model", "prefix", "tokens", "ETA lines", "first ETA", "first, rate only", "at 25 %",
              "at 50 %"]  # fmt: skip
    lines += table(header, rows)
    worst = max((abs(x["first"]["error"]) for x in r["rows"] if x["first"]), default=None)
    if worst is not None:
        verdict = "met" if worst < r["goal"] else "**missed**"
        lines += [f"Worst first-ETA error {worst:.0%} (goal < {r['goal']:.0%}): {verdict}.", ""]
    return lines


if __name__ == "__main__":
    import argparse
    import json
    import tempfile

    parser = argparse.ArgumentParser(description="the build ETA's error, standalone")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the small model (bench --quick's) at 4k, one demo prefix",
    )
    parser.add_argument("--lengths", help="comma list of bench-model lengths (overrides)")
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the results here")
    opts = parser.parse_args()
    if opts.lengths:
        chosen = [int(n) for n in opts.lengths.split(",") if n]
        settings = lambda quick: {"lengths": chosen}  # noqa: E731
    if opts.skip_demo:
        DEMO_PREFIXES = ()
    from common import ensure_models

    ensure_models()
    with tempfile.TemporaryDirectory() as work:
        results = run(Context(quick=opts.quick, work=Path(work)))
    if opts.json:
        opts.json.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print("\n".join(section(results)))
