"""ttft.png: time-to-first-token against prefix length, cold vs bundle (matplotlib, no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

STYLES = {
    ("cold", "restart"): ("tab:red", "-", "cold: process start → 1st token"),
    ("bundle", "restart"): ("tab:blue", "-", "bundle: process start → 1st token"),
    ("cold", "after_load"): ("tab:red", "--", "cold: model loaded → 1st token"),
    ("bundle", "after_load"): (
        "tab:blue",
        "--",
        "bundle: model loaded → 1st token (mount + request)",
    ),
}


def draw(ttft: dict[str, Any], path: Path, quick: bool) -> None:
    """Medians with min–max error bars, log-log axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
