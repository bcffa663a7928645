"""ttft.png: time-to-first-token against prefix length, cold vs bundle, and where a restart's
time goes (matplotlib, no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

STYLES = {
    ("cold", "restart"): ("tab:red", "-", "cold: process start → 1st token"),
    ("bundle", "restart"): ("tab:blue", "-", "bundle + warm-up: process start → 1st token"),
    ("cold", "after_load"): ("tab:red", "--", "cold: model loaded → 1st token"),
    ("bundle", "after_load"): (
        "tab:blue",
        "--",
        "bundle + warm-up: model loaded → 1st token",
    ),
}


def draw(ttft: dict[str, Any], path: Path, quick: bool) -> None:
    """Medians with min–max error bars, log-log axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bars) = plt.subplots(1, 2, figsize=(13, 4.8), width_ratios=(3, 2))
    rows = ttft["rows"]
    xs = [x["prefix_tokens"] for x in rows]
    for (kind, metric), (color, style, label) in STYLES.items():
        med = [x[kind][metric]["median"] for x in rows]
        low = [m - x[kind][metric]["min"] for m, x in zip(med, rows, strict=True)]
        high = [x[kind][metric]["max"] - m for m, x in zip(med, rows, strict=True)]
        ax.errorbar(
            xs,
            med,
            yerr=[low, high],
            color=color,
            linestyle=style,
            marker="o",
            capsize=3,
            label=label,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("prefix tokens")
    ax.set_ylabel("seconds (median, min–max)")
    title = "Restart time-to-first-token, Qwen3-0.6B-shaped float32 model, 2-core CPU"
    ax.set_title(title + (" (quick run)" if quick else ""), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    draw_breakdown(bars, ttft)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# A restart's phases in order (worker stamps), and the in-memory hit drawn beside them.
PHASES = (
    ("startup", "process start + imports", "tab:gray"),
    ("load", "model load", "tab:olive"),
    ("mount", "mount (verified)", "tab:blue"),
    ("fetch", "render + fetch", "tab:cyan"),
    ("suffix", "suffix prefill + 1st token", "tab:orange"),
)


def draw_breakdown(ax: Any, ttft: dict[str, Any]) -> None:
    """Stacked bars: each phase of a restart with the bundle, per prefix length (medians), and
    the in-memory hit of the same process's next request for comparison."""
    rows = [x for x in ttft["rows"] if "bundle_no_warmup" in x]
    rows += [ttft["long"]] if ttft.get("long") else []
    kind = "bundle_no_warmup"  # serve's defaults
    labels, bottoms = [str(x["prefix_tokens"]) for x in rows], [0.0] * len(rows)
    positions = list(range(len(rows)))
    for key, label, color in PHASES:
        heights = [x[kind][key]["median"] for x in rows]
        ax.bar(positions, heights, 0.38, bottom=bottoms, color=color, label=label)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    hits = [x[kind]["hit_request"]["median"] for x in rows]
    ax.bar(
        [p + 0.4 for p in positions],
        hits,
        0.38,
        color="tab:green",
        label="in-memory hit (next request)",
    )
    ax.set_xticks([p + 0.2 for p in positions], labels)
    ax.set_xlabel("prefix tokens")
    ax.set_ylabel("seconds (median)")
    ax.set_title("Restart with a bundle, serve defaults: where the time goes", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
