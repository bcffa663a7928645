"""Case 4, bundle size and load time for full-precision, 8-bit and 4-bit KV of the same prefix.

Uses the bench model as shipped (bfloat16), so full precision means bfloat16 KV (the serving
dtype); the builder computes in float32 on CPU and stores the serving dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import (
    MODEL_BF16,
    Context,
    dir_bytes,
    ratio,
    run_worker,
    stat,
    text_with_tokens,
    write_definition,
)
from common import target_row as _row  # noqa: E402
from report import cell, fidelity, table  # noqa: E402

SYSTEM = "You answer questions about these notes.\nNotes:\n"
KV_BITS = (None, 8, 4)


def settings(quick: bool) -> dict[str, int]:
    return {"tokens": 128, "reps": 1} if quick else {"tokens": 512, "reps": 3}


def build(ctx: Context, tokens: int, bits: int | None) -> dict[str, Any]:
    """One bundle of the shared prefix with the given kv_bits (fidelity check on, except quick)."""
    project = ctx.work / "sizes"
    name = f"sizes-kv{bits or 'full'}"
    msgs = [
        {"role": "system", "content": SYSTEM + text_with_tokens(MODEL_BF16, tokens - 14, seed=7)}
    ]
    cache = {"kv_bits": bits, "kv_group_size": 64 if bits else None}
    write_definition(project, name, MODEL_BF16, msgs, **cache)
    ctx.note(f"sizes: building kv_bits={bits or 'none'}")
    return run_worker(
        "build",
        {
            "project": str(project),
            "name": name,
            "bundles": str(project / "bundles"),
            "check": not ctx.quick,
        },
    )


def run(ctx: Context) -> dict[str, Any]:
    """Build the three variants, then time verified mounts of each (interleaved)."""
    cfg = settings(ctx.quick)
    built = {bits: build(ctx, cfg["tokens"], bits) for bits in KV_BITS}
    loads: dict[int | None, list[float]] = {bits: [] for bits in KV_BITS}
    for rep in range(cfg["reps"]):
        for bits, b in built.items():
            ctx.note(f"sizes: mount kv_bits={bits or 'none'} rep {rep + 1}")
            r = run_worker(
                "mount", {"variant": "verified", "model": str(MODEL_BF16), "bundle": b["bundle"]}
            )
            loads[bits].append(r["seconds"])
    full = (Path(built[None]["bundle"]) / "cache.safetensors").stat().st_size
    rows = []
    for bits, b in built.items():
        nbytes = (Path(b["bundle"]) / "cache.safetensors").stat().st_size
        rows.append(
            {
                "kv_bits": bits,
                "tokens": b["tokens"],
                "dtype": b["dtype"],
                "cache_bytes": nbytes,
                "bundle_bytes": dir_bytes(Path(b["bundle"]), "*"),
                "ratio_to_full": ratio(nbytes, full),
                "mount_s": stat(loads[bits]).as_dict(),
                "fidelity": b["fidelity"],
                "build": b,
            }
        )
    return {"model": str(MODEL_BF16), "tokens": cfg["tokens"], "rows": rows}


def section(r: dict[str, Any]) -> list[str]:
    lines = [
        f"## 4. Bundle size and load time (bfloat16 model as shipped, {r['tokens']}-token prefix)",
        "",
        "Full precision = bfloat16 KV (the serving dtype). Load = verified `pipeline.runtime.mount` "
        "in a fresh process, page cache warm. Fidelity = the builder's warm-vs-in-memory check.",
        "",
    ]
    rows = [
        [
            x["kv_bits"] or "none (bf16)",
            x["tokens"],
            f"{x['cache_bytes']:,}",
            f"{x['ratio_to_full']:.3f}×",
        ]
        + [cell(x["mount_s"])]
        + fidelity(x["fidelity"])
        for x in r["rows"]
    ]
    header = ["kv_bits", "tokens", "cache.safetensors bytes", "× full", "verified mount s"]
    return lines + table(header + ["max abs dlogit", "greedy match"], rows)


def targets(s: dict[str, Any]) -> list[dict[str, Any]]:
    """The bundle-size targets with their measured values."""
    out: list[dict[str, Any]] = []
    if True:
        by_bits = {r["kv_bits"]: r["ratio_to_full"] for r in s["rows"]}
        out.append(
            _row(
                "8-bit bundle ≤ 0.55× full-precision bytes",
                f"{by_bits[8]:.3f}×",
                by_bits[8] <= 0.55,
            )
        )
        out.append(
            _row(
                "4-bit bundle ≤ 0.32× full-precision bytes",
                f"{by_bits[4]:.3f}×",
                by_bits[4] <= 0.32,
            )
        )
    return out
