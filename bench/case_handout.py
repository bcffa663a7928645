"""Case handout: bench/bench_handout.py (PromptCacheManager.fetch vs deepcopy, the first decode
step after a hand-out) and bench/frozen_base.py, each in a process of its own (worker tasks)."""

from __future__ import annotations

from typing import Any

from common import BENCH, HUGE_PAGES, MODEL_F32, Context, run_worker


def run(ctx: Context) -> dict[str, Any] | None:
    """The hand-out benchmark in its own process (and with huge pages unless --quick)."""
    if not (BENCH / "bench_handout.py").is_file():
        return None
    r = run_worker("handout", {"quick": ctx.quick})
    # serve --huge-pages on; --quick leaves this rerun out (the report then omits its table)
    huge = None if ctx.quick else run_worker("handout", {"quick": ctx.quick}, **HUGE_PAGES)
    frozen = run_worker(
        "frozen_base", {"model": str(MODEL_F32), "tokens": 2048 if ctx.quick else 16384}
    )
    return {
        "result": r["result"],
        "markdown": r["markdown"],
        "seconds": r["process_seconds"],
        "hugepages": huge and {"result": huge["result"], "markdown": huge["markdown"]},
        "frozen_base": {"result": frozen["result"], "markdown": frozen["markdown"]},
    }


def section(h: dict[str, Any] | None) -> list[str]:
    lines = [
        "## 7. Hand-out and first decode step (`bench/bench_handout.py`, `bench/frozen_base.py`)",
        "",
    ]
    if h is None:
        return lines + [
            "HOOK: `bench/bench_handout.py` (`run(quick) -> dict`) not found; nothing ran.",
            "",
        ]
    lines += [h.get("markdown") or f"```\n{h['result']}\n```", ""]
    if h.get("hugepages"):
        lines += [
            "The same, in a process started with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` "
            "(`serve --huge-pages on`):",
            "",
            h["hugepages"]["markdown"],
            "",
        ]
    if h.get("frozen_base"):
        lines += [h["frozen_base"]["markdown"], ""]
    return lines
