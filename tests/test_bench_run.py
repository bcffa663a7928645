"""bench/run.py, the runner CI runs as `python bench/run.py --quick` (issue 50): a case that raises,
or reports a failed part, fails the whole run (non-zero exit, the case named), the other cases still
run and report, and the end of the run prints each case's time. The registry is replaced by cases
of this test (a good one, a broken one, one with a failed part); the runner is the real one, run
in a fresh process as CI runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DRIVER = textwrap.dedent(
    """
    import sys
    sys.path[:0] = [{bench!r}, {root!r}]
    import cases, run
    from cases import Case

    def broken(ctx, results):
        raise RuntimeError("this case broke")

    cases.REGISTRY = (
        Case("good", lambda ctx, r: {{"ok": 1}}, lambda x, r: ["## good ran", ""]),
        Case("broken", broken, lambda x, r: ["## broken"]),
        Case("part", lambda ctx, r: {{"rows": 1}}, lambda x, r: ["## part ran", ""],
             failures=lambda x: {{"part row": "a row failed"}}),
    )
    cases.BY_NAME = {{c.name: c for c in cases.REGISTRY}}
    cases.SELECTABLE = tuple(cases.BY_NAME)
    sys.exit(run.main(sys.argv[1:]))
    """
)


def bench(tmp_path: Path, selected: str) -> subprocess.CompletedProcess:
    driver = DRIVER.format(bench=str(ROOT / "bench"), root=str(ROOT))
    args = ["--cases", selected, "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]
    return subprocess.run(
        [sys.executable, "-c", driver, *args], capture_output=True, text=True, timeout=300
    )


def test_a_broken_case_fails_the_run_and_the_others_still_report(tmp_path: Path):
    proc = bench(tmp_path, "good,broken,part")
    assert proc.returncode == 1, proc.stderr
    results = json.loads((tmp_path / "work" / "results.json").read_text())
    assert set(results["errors"]) == {"broken", "part row"}
    assert "this case broke" in results["errors"]["broken"]
    report = (tmp_path / "out" / "RESULTS.md").read_text()
    assert "## good ran" in report and "## part ran" in report
    assert "**Case broken failed:**" in report
    assert "FAILED: broken" in proc.stderr and "FAILED: part row" in proc.stderr
    lines = proc.stderr.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.split() == ["case", "seconds"]) :]
    assert [line.split()[0] for line in table[1:5]] == ["calibration", "good", "broken", "part"]
    assert table[3].endswith("FAILED") and table[4].split()[0] == "part"
    assert table[5].split()[0] == "total"


def test_a_run_whose_cases_pass_exits_0(tmp_path: Path):
    proc = bench(tmp_path, "good")
    assert proc.returncode == 0, proc.stderr
    assert "FAILED" not in proc.stderr


def test_an_unknown_case_is_a_usage_error(tmp_path: Path):
    proc = bench(tmp_path, "good,nosuch")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: unknown case(s) nosuch; choose from good, broken, part"
    )
