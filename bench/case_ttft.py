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
    SYSTEM,
    TEMPLATE_TOKENS,
    Context,
    ratio,
    run_worker,
    stat,
    text_with_tokens,
    write_definition,
)
from common import target_row as _row  # noqa: E402
from report import cell, fidelity, table  # noqa: E402

STEP = 512  # prefill chunk for cold and warm alike, fixed: independent of the builder's default


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


TTFT_INTRO = (
    "A fresh process imports, loads the model (`mlx_lm.load`), then mounts the prefix's bundle "
    "(`pipeline.runtime.mount` into a `PromptCacheManager`) or not (cold), renders the request "
    "(prefix + one user question) with the model's chat template, fetches from the manager, "
    "prefills what the cache lacks in chunks of {step} (both paths) and takes the greedy first "
    "token. OpenBLAS preloaded in both; page cache warm. Seconds, median (min–max). *restart* = "
    "process spawn → first token; *after load* = model loaded → first token (mount + request: "
    "the part a bundle changes); *request* = startup done (mount included in startup) → first token."
)


def section(r: dict[str, Any], builds: list[dict[str, Any]]) -> list[str]:
    lines = ["## 2. Restart time-to-first-token (float32 model, float32 KV)", ""]
    lines += [TTFT_INTRO.format(step=r["step"]), ""]
    rows = []
    for x in r["rows"]:
        c, b = x["cold"], x["bundle"]
        rows.append(
            [
                x["prefix_tokens"],
                cell(c["restart"]),
                cell(b["restart"]),
                f"{x['speedup_restart']:.1f}×",
            ]
            + [cell(c["after_load"]), cell(b["after_load"]), f"**{x['speedup_after_load']:.1f}×**"]
            + [cell(b["request"]), f"{x['speedup_request']:.0f}×"]
            + [
                f"{c['restart']['n']}/{b['restart']['n']}",
                "yes" if x["same_first_token"] else "**no**",
            ]
        )
    header = ["prefix tokens", "cold restart", "bundle restart", "×", "cold after load"]
    header += ["bundle after load", "×", "bundle request", "×", "n cold/bundle", "same 1st token"]
    lines += table(header, rows)
    if any(x["bundle"].get("warmup", {}).get("median", 0) > 0.01 for x in r["rows"]):
        lines += [
            "The *bundle* runs above include the warm-up step (`serve --warm-up`, off by default "
            "since this run measured it): serve's defaults are the *no warm-up* rows of the "
            "restart-vs-hit table below and the targets table.",
            "",
        ]
    lines += [
        "Where the bundle runs' time goes (medians; seconds, and minor page faults = first touches "
        "of fresh 4 KiB pages):",
        "",
    ]
    phases = ("startup", "load", "mount", "warmup", "fetch", "suffix")
    header = ["prefix tokens", "imports", "model load", "mount", "warm-up", "render + fetch"]
    header += ["suffix prefill + 1st token", "faults in mount", "faults in request"]
    rows = [
        [x["prefix_tokens"]]
        + [f"{x['bundle'][p]['median']:.3f}" for p in phases]
        + [f"{x['bundle'][f]['median']:,.0f}" for f in ("mount_faults", "request_faults")]
        for x in r["rows"]
    ]
    lines += table(header, rows)
    lines += restart_vs_hit(r)
    n = r["crossover_after_load"]
    if n is not None:
        lines.append(
            f"- crossover (after load), linear through the two shortest lengths: **{n:.0f} tokens**"
            + (" (≤ 0: a bundle pays for any prefix)" if n <= 0 else "")
            + "; the restart figures add the same imports + model load to both sides."
        )
    lines += ["", "Bundle builds (float32 model, fidelity check on):", ""]
    header = [
        "tokens",
        "prefill tok/s",
        "build call s",
        "cache bytes",
        "max abs dlogit",
        "greedy match",
    ]
    rows = [
        [
            b["tokens"],
            f"{b['prefill_tok_s']:.1f}",
            f"{b['build_seconds']:.1f}",
            f"{b['cache_bytes']:,}",
        ]
        + fidelity(b["fidelity"])
        for b in builds
    ]
    return lines + table(header, rows)


KINDS = {
    "bundle": "warm-up on (serve --warm-up)",
    "bundle_hugepages": "warm-up + huge pages",
    "bundle_no_warmup": "no warm-up (serve default)",
}


def restart_vs_hit(r: dict[str, Any]) -> list[str]:
    """The first request after a restart (bundle mounted) vs the same process's next request
    after the same prefix (an in-memory hit), for the long prefixes; with huge pages on and off."""
    lines = [
        "",
        "First request after a restart vs an in-memory hit: *request* = fetch from the manager + "
        "suffix prefill + first token of the first request after startup (bundle mounted); *hit* "
        "= the same for the next request in the same process, another question after the same "
        "prefix, served from request 1's stored cache (serve's path); *store* = keeping request "
        "1's cache (copy-on-write); *warm-up* = `serve`'s one throwaway decode step from the "
        "mounted bundle after the model loads (`--warm-up`, off by default), before the first "
        "request. *huge pages* = the same runs with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` "
        "(`serve --huge-pages on`); *no warm-up* = `--no-warm-up`. Seconds, median (min–max); "
        "faults = minor page faults.",
        "",
    ]
    rows = []
    for x in [y for y in r["rows"] if "bundle_hugepages" in y] + (
        [r["long"]] if r.get("long") else []
    ):
        for kind, how in KINDS.items():
            if kind not in x:
                continue
            k = x[kind]
            rows.append(
                [
                    x["prefix_tokens"],
                    how,
                    cell(k["mount"]),
                    cell(k["warmup"]),
                    cell(k["request"]),
                    cell(k["hit_request"]),
                    f"**{k['request_over_hit']:.2f}×**",
                    cell(k["store"]),
                    f"{k['request_faults']['median']:,.0f}",
                    f"{k['hit_faults']['median']:,.0f}",
                    k["request"]["n"],
                ]
            )
    header = ["prefix tokens", "runs", "mount", "warm-up", "request", "hit", "request / hit"]
    header += ["store"]
    header += ["faults in request", "faults in hit (incl. store)", "n"]
    return lines + table(header, rows)


def targets(t: dict[str, Any]) -> list[dict[str, Any]]:
    """The restart targets with their measured values."""
    out: list[dict[str, Any]] = []
    if True:
        x = t["rows"][-1]
        at = f"at {x['prefix_tokens']} tokens" + (
            " (quick; target is for 4k)" if x["length"] < 4096 else ""
        )
        out.append(
            _row(
                "restart TTFT ≥ 50× faster than cold — after model load (mount + warm-up + request)",
                f"{x['speedup_after_load']:.1f}× {at}",
                x["speedup_after_load"] >= 50,
            )
        )
        out.append(
            _row(
                "restart TTFT ≥ 50× faster than cold — process start → first token, with warm-up",
                f"{x['speedup_restart']:.1f}× {at}",
                x["speedup_restart"] >= 50,
            )
        )
    if True:
        for x in (y for y in t["rows"] if "bundle_no_warmup" in y and y["length"] == 4096):
            nw, cold = x["bundle_no_warmup"], x["cold"]
            for metric, label in (
                ("after_load", "after model load"),
                ("restart", "process start → first token"),
            ):
                got = cold[metric]["median"] / nw[metric]["median"]
                out.append(
                    _row(
                        f"restart TTFT ≥ 50× faster than cold — {label}, serve defaults (no warm-up)",
                        f"{got:.1f}× at {x['prefix_tokens']} tokens",
                        got >= 50,
                    )
                )
            share = (nw["fetch"]["median"] + nw["store"]["median"]) / nw["request"]["median"]
            out.append(
                _row(
                    "serve's request work outside the forward pass (render, tokenize, fetch, store) "
                    "≤ 5 % of the request",
                    f"{share:.1%} at {x['prefix_tokens']} tokens",
                    share <= 0.05,
                )
            )
        for x in [y for y in t["rows"] if y["length"] == 4096] + [t["long"]] * bool(t.get("long")):
            for kind, how in (
                ("bundle", ", warm-up"),
                ("bundle_hugepages", ", warm-up + huge pages"),
                ("bundle_no_warmup", ", serve defaults (no warm-up)"),
            ):
                if kind in x:
                    got = x[kind]["request_over_hit"]
                    out.append(
                        _row(
                            f"first request after restart ≤ 1.1× an in-memory hit — "
                            f"{x['prefix_tokens']} tokens{how}",
                            f"{got:.2f}×",
                            got <= 1.1,
                        )
                    )
    return out
