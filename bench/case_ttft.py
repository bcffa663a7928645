"""Case 2, restart time-to-first-token: a fresh process loads the model and answers one request,
with the prefix's bundle mounted (pipeline.runtime.mount + PromptCacheManager) or cold.

Also builds the bundles (float32 model, full-precision KV, fidelity check on as the CLI ships)
that cases 3 and 5 reuse.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import (
    MODEL_F32,
    QUESTION,
    Context,
    ratio,
    run_worker,
    stat,
    text_with_tokens,
    write_definition,
)

SYSTEM = "You are the assistant of a field team. Answer from these notes only.\nNotes:\n"
STEP = 512  # prefill chunk for cold and warm alike, fixed: independent of the builder's default
TEMPLATE_TOKENS = 16  # tokens the template and SYSTEM add around the notes (measured: ~14)


def lengths(quick: bool) -> list[int]:
    """Prefix lengths in tokens."""
    return [128, 384] if quick else [128, 512, 1024, 2048, 4096]


def cold_reps(length: int, quick: bool) -> int:
    """Cold runs cost minutes at 4k on 2 cores: fewer repetitions for the long ones."""
    return 2 if quick or length >= 2048 else 3


def warm_reps(quick: bool) -> int:
    return 2 if quick else 3


def messages_for(length: int) -> list[dict[str, str]]:
    """The prefix: one system message of about `length` tokens."""
    notes = text_with_tokens(MODEL_F32, length - TEMPLATE_TOKENS, seed=length)
    return [{"role": "system", "content": SYSTEM + notes}]


def build_bundles(ctx: Context) -> list[dict[str, Any]]:
    """Build one bundle per length with pipeline.build.builder.build, each in a fresh process."""
    project = ctx.work / "ttft"
    built = []
    for length in lengths(ctx.quick):
        name = f"ttft-{length}"
        msgs = messages_for(length)
        write_definition(project, name, MODEL_F32, msgs)
        ctx.note(f"ttft: building the {length}-token bundle")
        r = run_worker(
            "build",
            {
                "project": str(project),
                "name": name,
                "bundles": str(project / "bundles"),
                "check": True,
            },
        )
        # a deployed bundle has been mounted before: later mounts hit the verify-once memo
        run_worker("mount", {"variant": "verified", "model": str(MODEL_F32), "bundle": r["bundle"]})
        r.update(
            length=length,
            messages=msgs,
            cache_bytes=(Path(r["bundle"]) / "cache.safetensors").stat().st_size,
        )
        built.append(r)
    return built


def one_run(bundle: dict[str, Any], warm: bool) -> dict[str, float]:
    """Seconds of each phase of one fresh-process first request."""
    r = run_worker(
        "ttft",
        {
            "model": str(MODEL_F32),
            "bundle": bundle["bundle"] if warm else None,
            "messages": bundle["messages"],
            "question": QUESTION,
            "step": STEP,
        },
    )
    s, f = r["stamps"], r["faults"]
    return {
        "mount_faults": f["mounted"] - f["loaded"],
        "request_faults": f["first_token"] - f["mounted"],
        "restart": s["first_token"] - r["spawn_time"],
        "after_load": s["first_token"] - s["loaded"],
        "request": s["first_token"] - s["mounted"],
        "mount": s["mounted"] - s["loaded"],
        "fetch": s["fetched"] - s["mounted"],  # render + tokenize the request, manager lookup
        "suffix": s["first_token"] - s["fetched"],  # prefill what the cache lacks + 1st token
        "load": s["loaded"] - s["imported"],
        "startup": s["imported"] - r["spawn_time"],
        "tokens": r["tokens"],
        "hit_tokens": r["hit_tokens"],
        "token": r["token"],
    }


def measure(ctx: Context, bundle: dict[str, Any]) -> dict[str, Any]:
    """Interleaved cold and warm runs for one length."""
    runs: dict[str, list[dict[str, float]]] = {"cold": [], "bundle": []}
    n = {"cold": cold_reps(bundle["length"], ctx.quick), "bundle": warm_reps(ctx.quick)}
    for rep in range(max(n.values())):
        for kind in (k for k in ("cold", "bundle") if rep < n[k]):
            ctx.note(f"ttft: {bundle['length']} tokens, {kind} rep {rep + 1}")
            runs[kind].append(one_run(bundle, kind == "bundle"))
    out: dict[str, Any] = {"length": bundle["length"], "prefix_tokens": bundle["tokens"]}
    for kind, got in runs.items():
        out[kind] = {m: stat([g[m] for g in got]).as_dict() for m in got[0] if m not in ("token",)}
        out[kind]["first_tokens"] = sorted({g["token"] for g in got})
    out["same_first_token"] = out["cold"]["first_tokens"] == out["bundle"]["first_tokens"]
    for m in ("restart", "after_load", "request"):
        out[f"speedup_{m}"] = ratio(out["cold"][m]["median"], out["bundle"][m]["median"])
    return out


def crossover(rows: list[dict[str, Any]], metric: str) -> float | None:
    """Prefix length where cold and bundle cost the same, from the two shortest lengths (linear)."""
    if len(rows) < 2:
        return None
    (a, b) = rows[0], rows[1]
    n0, n1 = a["prefix_tokens"], b["prefix_tokens"]
    gap0 = a["cold"][metric]["median"] - a["bundle"][metric]["median"]
    gap1 = b["cold"][metric]["median"] - b["bundle"][metric]["median"]
    if gap1 == gap0:
        return None
    return n0 - gap0 * (n1 - n0) / (gap1 - gap0)  # where the cold-minus-bundle gap reaches zero


def run(ctx: Context, bundles: list[dict[str, Any]]) -> dict[str, Any]:
    """Every length, cold vs bundle, with speedups and crossovers."""
    rows = [measure(ctx, b) for b in bundles]
    return {
        "step": STEP,
        "question": QUESTION,
        "rows": rows,
        "crossover_after_load": crossover(rows, "after_load"),
    }
