"""Case memory: peak RSS above baseline of the other cases' fresh processes (builds, mounts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import dir_bytes
from common import target_row as _row  # noqa: E402
from report import GB, table


def memory(
    builds: list[dict[str, Any]], sizes: dict[str, Any] | None, mount: dict[str, Any] | None
) -> dict:
    """Peak RSS above baseline of builds and mounts, against model and bundle bytes."""
    rows = []
    for b in builds:
        rows.append(_build_row(b, f"build {b['tokens']} tokens, float32 model, check on"))
    for x in (sizes or {}).get("rows", []):
        b = x["build"]
        rows.append(
            _build_row(b, f"build {b['tokens']} tokens, bfloat16 model, kv_bits={x['kv_bits']}")
        )
    if mount:
        for variant in ("verified", "verified_first", "unchecked", "python_read"):
            v = mount["rows"][variant]
            rows.append(
                {
                    "what": f"mount {mount['tokens']} tokens: {variant}",
                    "peak_above": v["rss_above_baseline"]["median"],
                    "bundle_bytes": mount["cache_bytes"],
                }
            )
    return {"rows": rows}


def _build_row(b: dict[str, Any], what: str) -> dict[str, Any]:
    from common import MODEL_BF16, MODEL_F32

    model = MODEL_F32 if b["dtype"] == "float32" else MODEL_BF16
    widen = 2 if b["dtype"] != "float32" and b.get("compute_dtype") == "float32" else 1
    return {
        "what": what,
        "peak_above": b["rss_peak"] - b["rss_baseline"],
        "model_bytes": dir_bytes(model),
        "compute_model_bytes": dir_bytes(model) * widen,  # the weights as the prefill holds them
        "bundle_bytes": (Path(b["bundle"]) / "cache.safetensors").stat().st_size,
        "kv_bits": b["kv_bits"],
    }


def section(m: dict[str, Any]) -> list[str]:
    lines = [
        "## 5. Memory",
        "",
        "Peak RSS above the baseline taken after imports (peak reset there via /proc/self/clear_refs, so import transients cannot hide a step), fresh processes.",
        "",
    ]
    rows = []
    for x in m["rows"]:
        model = x.get("model_bytes")
        rows.append(
            [x["what"], f"{x['peak_above'] / GB:.3f}", f"{model / GB:.3f}" if model else "–"]
            + [f"{x['bundle_bytes'] / GB:.3f}", f"{x['peak_above'] / model:.2f}×" if model else "–"]
            + [f"{x['peak_above'] / x['bundle_bytes']:.2f}×"]
            + [
                f"{x['peak_above'] / (x['compute_model_bytes'] + x['bundle_bytes']):.2f}×"
                if "compute_model_bytes" in x
                else "–"
            ]
        )
    header = ["what", "peak above baseline GB", "model GB", "bundle GB", "/ model", "/ bundle"]
    header += ["/ (model in compute dtype + bundle)"]
    return lines + table(header, rows)


def targets(m: dict[str, Any]) -> list[dict[str, Any]]:
    """The builder's peak-memory targets with their measured values."""
    out: list[dict[str, Any]] = []
    for x in m.get("rows", []):
        if "compute_model_bytes" in x and "bfloat16 model" in x["what"]:
            over = x["peak_above"] / (x["compute_model_bytes"] + x["bundle_bytes"])
            out.append(
                _row(
                    f"builder peak memory ≤ 1.3× (model in compute dtype + bundle) — {x['what']}",
                    f"{over:.2f}×",
                    over <= 1.3,
                )
            )
    return out


def run(results: dict[str, Any]) -> dict[str, Any]:
    """The memory rows of the builds and mounts the other cases ran."""
    found = memory(results.get("ttft_bundles") or [], results.get("sizes"), results.get("mount"))
    return found if found["rows"] else None
