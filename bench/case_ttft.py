"""Case 2, restart time-to-first-token: a fresh process loads the model and answers one request,
with the prefix's bundle mounted (pipeline.runtime.mount + PromptCacheManager) or cold.

Also builds the bundles (float32 model, full-precision KV, fidelity check on as the CLI ships)
that cases 3 and 5 reuse.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import (
    HUGE_PAGES,
    MODEL_F32,
    QUESTION,
    QUESTION2,
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


def long_length(quick: bool) -> int:
    """A long prefix measured with the bundle only (its cold run would take many minutes)."""
    return 1024 if quick else 16384


def kinds(length: int, quick: bool) -> dict[str, int]:
    """Run kinds and repetitions for a length; huge pages where the copies are big."""
    n = {"cold": cold_reps(length, quick), "bundle": warm_reps(quick)}
    if length >= (1024 if quick else 2048):  # quick: the long, bundle-only prefix
        n["bundle_hugepages"] = n["bundle_no_warmup"] = warm_reps(quick)
    return n


def cold_reps(length: int, quick: bool) -> int:
    """Cold runs cost minutes at 4k on 2 cores: fewer repetitions for the long ones."""
    return 1 if quick else 2 if length >= 2048 else 3


def warm_reps(quick: bool) -> int:
    return 1 if quick else 3


def messages_for(length: int) -> list[dict[str, str]]:
    """The prefix: one system message of about `length` tokens."""
    notes = text_with_tokens(MODEL_F32, length - TEMPLATE_TOKENS, seed=length)
    return [{"role": "system", "content": SYSTEM + notes}]


def build_bundles(ctx: Context, extra: list[int] | None = None) -> list[dict[str, Any]]:
    """Build one bundle per length with pipeline.builder.builder.build, each in a fresh process;
    the `extra` lengths without the fidelity check (its cold prefill would double the cost)."""
    project = ctx.work / "ttft"
    built = []
    for length in extra or lengths(ctx.quick):
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
                "check": extra is None,
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


def one_run(bundle: dict[str, Any], kind: str) -> dict[str, float]:
    """Seconds of each phase of one fresh-process first request, and of the next request."""
    r = run_worker(
        "ttft",
        {
            "model": str(MODEL_F32),
            "bundle": bundle["bundle"] if kind != "cold" else None,
            "messages": bundle["messages"],
            "question": QUESTION,
            "question2": QUESTION2,
            "step": STEP,
            "warm_up": kind in ("bundle", "bundle_hugepages"),  # serve --warm-up
        },
        **(HUGE_PAGES if kind == "bundle_hugepages" else {}),
    )
    s, f = r["stamps"], r["faults"]
    return {
        "mount_faults": f["mounted"] - f["loaded"],
        "request_faults": f["first_token"] - f["warmed"],
        "restart": s["first_token"] - r["spawn_time"],
        "after_load": s["first_token"] - s["loaded"],
        "request": s["first_token"] - s["warmed"],
        "mount": s["mounted"] - s["loaded"],
        "warmup": s["warmed"] - s["mounted"],  # one throwaway decode step (serve --warm-up)
        "fetch": s["fetched"] - s["warmed"],  # render + tokenize the request, manager lookup
        "suffix": s["first_token"] - s["fetched"],  # prefill what the cache lacks + 1st token
        "load": s["loaded"] - s["imported"],
        "store": s["stored"] - s["first_token"],  # keep request 1's cache (copy-on-write)
        "hit_request": s["second_token"] - s["stored"],  # an in-memory hit, same process
        "hit_faults": f["second_token"] - f["first_token"],
        "startup": s["imported"] - r["spawn_time"],
        "tokens": r["tokens"],
        "hit_tokens": r["hit_tokens"],
        "token": r["token"],
    }


def measure(ctx: Context, bundle: dict[str, Any], n: dict[str, int]) -> dict[str, Any]:
    """Interleaved runs of each kind (cold, bundle, bundle with huge pages) for one length."""
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in n}
    for rep in range(max(n.values())):
        for kind in (k for k in n if rep < n[k]):
            ctx.note(f"ttft: {bundle['length']} tokens, {kind} rep {rep + 1}")
            runs[kind].append(one_run(bundle, kind))
    out: dict[str, Any] = {"length": bundle["length"], "prefix_tokens": bundle["tokens"]}
    for kind, got in runs.items():
        out[kind] = {m: stat([g[m] for g in got]).as_dict() for m in got[0] if m not in ("token",)}
        out[kind]["first_tokens"] = sorted({g["token"] for g in got})
        # goal: the first request after a restart costs what an in-memory hit costs
        out[kind]["request_over_hit"] = ratio(
            out[kind]["request"]["median"], out[kind]["hit_request"]["median"]
        )
    if "cold" in out:
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
    """Every length, cold vs bundle, with speedups and crossovers; then the long prefix, bundle
    only, for the restart-vs-in-memory-hit comparison."""
    rows = [measure(ctx, b, kinds(b["length"], ctx.quick)) for b in bundles]
    (long_bundle,) = build_bundles(ctx, [long_length(ctx.quick)])
    n = {k: v for k, v in kinds(long_bundle["length"], ctx.quick).items() if k != "cold"}
    long = measure(ctx, long_bundle, n)
    long["cache_bytes"] = long_bundle["cache_bytes"]
    return {
        "step": STEP,
        "question": QUESTION,
        "rows": rows,
        "long": long,
        "crossover_after_load": crossover(rows, "after_load"),
    }
