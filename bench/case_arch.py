"""Case 7, one row per architecture (issue 11): mount time and restart first token on tiny models.

For every architecture in `pipeline.testmodels.arch.CONFIGS` (read at run time, so architectures
added there get a row without touching the bench): generate the tiny model (float32) into the
work folder, build a bundle of a prefix longer than any sliding window (fidelity check on, as the
CLI ships), then in fresh worker processes, interleaved: verified `pipeline.runtime.mount`,
mlx_lm's unchecked `load_prompt_cache` (+ `mx.eval`), and a restart's first token cold vs with the
bundle (worker tasks `mount` and `ttft`, the same code as cases 2 and 3).

The models are tiny (a few hundred KB of KV), so the figures are fixed costs per architecture
(fingerprints, manifest, sums, cache classes rebuilt, the fetch), not bandwidth: what a
regression in the per-kind code paths would move.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

from common import (
    QUESTION,
    QUESTION2,
    SYSTEM,
    TEMPLATE_TOKENS,
    Context,
    each,
    ratio,
    run_worker,
    stat,
    text_with_tokens,
    write_definition,
)
from report import cell, table  # noqa: E402

DTYPE = "float32"
STEP = 512  # prefill chunk of the cold and the bundle request alike (as case 2)
PREFIX_TOKENS = 2048  # > every sliding window in CONFIGS (gemma3_text: 32); clamped to the model
SERIES = ("verified", "unchecked", "cold", "bundle")


def reps(quick: bool) -> int:
    return 1 if quick else 5


def architectures() -> dict[str, dict[str, Any]]:
    """The CONFIGS of pipeline.testmodels.arch as they are now (others add architectures)."""
    from pipeline.testmodels.arch import CONFIGS

    return dict(CONFIGS)


def generate(arch: str, out: Path, tokenizer_from: Path) -> Path:
    """The tiny model of `arch` in float32 (the generator's default; passed when it takes one)."""
    from pipeline.testmodels.arch import generate_arch_model

    kwargs = (
        {"dtype": DTYPE} if "dtype" in inspect.signature(generate_arch_model).parameters else {}
    )
    return generate_arch_model(out, arch, tokenizer_from, **kwargs)


def prefix_length(config: dict[str, Any], quick: bool = False) -> int:
    """PREFIX_TOKENS (quick: 512), leaving room for the question within the model's positions."""
    room = int(config.get("max_position_embeddings") or 1 << 30) - 256
    wanted = 512 if quick else PREFIX_TOKENS
    return max(min(wanted, room), 2 * int(config.get("sliding_window") or 0), 64)


def prepare(ctx: Context, arch: str, config: dict[str, Any], model: Path) -> dict[str, Any]:
    """Definition and bundle of one architecture's model; the bundle mounted once (memo primed)."""
    root = ctx.work / "arch"
    length = prefix_length(config, ctx.quick)
    notes = text_with_tokens(model, length - TEMPLATE_TOKENS, seed=length)
    messages = [{"role": "system", "content": SYSTEM + notes}]
    name = f"arch-{arch}".replace("_", "-")
    write_definition(root / "project", name, model, messages)
    ctx.note(f"arch: {arch}: building a {length}-token bundle")
    args = {"project": str(root / "project"), "name": name, "check": True}
    built = run_worker("build", args | {"bundles": str(root / "project" / "bundles")})
    bundle = Path(built["bundle"])
    # a deployed bundle has been mounted before: later mounts hit the verify-once memo (a restart;
    # --quick: its one verified mount is the first, the same code path)
    if not ctx.quick:
        run_worker("mount", {"variant": "verified", "model": str(model), "bundle": str(bundle)})
    manifest = json.loads((bundle / "manifest.json").read_text())
    return {
        "model": model,
        "bundle": bundle,
        "messages": messages,
        "tokens": built["tokens"],
        "kv_dtype": built["dtype"],
        "classes": manifest["cache"]["classes"],
        "cache_bytes": (bundle / "cache.safetensors").stat().st_size,
        "model_bytes": (model / "model.safetensors").stat().st_size,
        "build_seconds": built["build_seconds"],
        "fidelity": built["fidelity"],
    }


def one(kind: str, p: dict[str, Any]) -> dict[str, Any]:
    """One fresh-process measurement of one series."""
    if kind in ("verified", "unchecked"):
        args = {"variant": kind, "model": str(p["model"]), "bundle": str(p["bundle"])}
        return {"seconds": run_worker("mount", args)["seconds"]}
    args = {
        "model": str(p["model"]),
        "bundle": str(p["bundle"]) if kind == "bundle" else None,
        "messages": p["messages"],
        "question": QUESTION,
        "question2": QUESTION2,  # the worker answers a second request too (the in-memory hit)
        "step": STEP,
    }
    r = run_worker("ttft", args)
    s = r["stamps"]
    return {
        "restart": s["first_token"] - r["spawn_time"],
        "after_load": s["first_token"] - s["loaded"],
        "request": s["first_token"] - s["mounted"],
        "token": r["token"],
        "hit_tokens": r["hit_tokens"],
        "request_tokens": r["tokens"],
    }


def summarise(arch: str, p: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> dict:
    """One architecture's row: medians, spreads, ratios of medians, hit and first-token checks."""
    med = lambda kind, m: stat([g[m] for g in runs[kind]]).as_dict()  # noqa: E731
    out: dict[str, Any] = {
        "arch": arch,
        "classes": p["classes"],
        "tokens": p["tokens"],
        "kv_dtype": p["kv_dtype"],
        "cache_bytes": p["cache_bytes"],
        "model_bytes": p["model_bytes"],
        "build_seconds": p["build_seconds"],
        "fidelity": p["fidelity"],
        "verified": med("verified", "seconds"),
        "unchecked": med("unchecked", "seconds"),
    }
    for kind in ("cold", "bundle"):
        out[kind] = {m: med(kind, m) for m in ("restart", "after_load", "request")}
        out[kind]["first_tokens"] = sorted({g["token"] for g in runs[kind]})
    out["hit_tokens"] = sorted({g["hit_tokens"] for g in runs["bundle"]})
    out["full_hit"] = out["hit_tokens"] == [p["tokens"]]
    out["same_first_token"] = out["cold"]["first_tokens"] == out["bundle"]["first_tokens"]
    out["mount_over_unchecked"] = ratio(out["verified"]["median"], out["unchecked"]["median"])
    for m in ("restart", "after_load", "request"):
        out[f"speedup_{m}"] = ratio(out["cold"][m]["median"], out["bundle"][m]["median"])
    return out


def failed(ctx: Context, arch: str, exc: Exception) -> dict[str, str]:
    ctx.note(f"arch: {arch} FAILED: {exc}")
    return {"arch": arch, "error": f"{type(exc).__name__}: {exc}"[:300]}


def run(ctx: Context) -> dict[str, Any]:
    """Every architecture of CONFIGS; a failing one is reported in its row, the others still run.

    Interleaved across architectures too (rep 1 of all, rep 2 of all, ...), so a slow phase of
    the machine spreads over the rows instead of landing on one.
    """
    from pipeline.testmodels.model import generate_model

    tiny = generate_model(ctx.work / "arch" / "models" / "tiny")  # tokenizer + template donor
    archs, errors = architectures(), {}
    prepared: dict[str, dict[str, Any]] = {}
    # --quick, a smoke: two architectures at a time (its figures are not compared across runs)
    workers = 2 if ctx.quick else 1
    # the models one after the other, here (generating seeds MLX's one random state)
    models = each(
        1, {a: lambda a=a: generate(a, ctx.work / "arch" / "models" / a, tiny) for a in archs}
    )
    made = each(
        workers,
        {
            a: lambda a=a: prepare(ctx, a, archs[a], models[a][0])
            for a in archs
            if models[a][1] is None
        },
    )
    made |= {a: got for a, got in models.items() if got[1] is not None}
    for arch, (got, exc) in made.items():
        if exc is None:
            prepared[arch] = got
        else:  # one broken architecture must not hide the others' rows
            errors[arch] = failed(ctx, arch, exc)
    runs = {arch: {k: [] for k in SERIES} for arch in prepared}
    for rep in range(reps(ctx.quick)):
        ctx.note(f"arch: rep {rep + 1} of {reps(ctx.quick)} ({', '.join(SERIES)} per architecture)")
        live = [a for a in prepared if a not in errors]
        series = {a: lambda a=a: [one(kind, prepared[a]) for kind in SERIES] for a in live}
        for arch, (got, exc) in each(workers, series).items():
            if exc is not None:
                errors[arch] = failed(ctx, arch, exc)
                continue
            for kind, one_run in zip(SERIES, got, strict=True):
                runs[arch][kind].append(one_run)
    rows = [errors.get(a) or summarise(a, prepared[a], runs[a]) for a in archs]
    return {
        "dtype": DTYPE,
        "step": STEP,
        "question": QUESTION,
        "reps": reps(ctx.quick),
        "workers": workers,
        "rows": rows,
    }


ARCH_INTRO = (
    "One row per architecture of `pipeline.testmodels.arch.CONFIGS` (read at run time): a tiny "
    "model of that architecture ({dtype}, random weights, the tiny Qwen3 test tokenizer and "
    "template), one bundle of a prefix longer than any sliding window (builder, fidelity check "
    "on, {dtype} KV). Fresh processes, the four series interleaved, n = {reps} each, page cache "
    "warm. *verified mount* = `pipeline.runtime.mount` on a restart (the bundle was mounted once "
    "after its build: verify-once memo hit), timed after the imports; *unchecked* = mlx_lm "
    "`load_prompt_cache` + `mx.eval`; *after load* = model loaded → greedy first token of the "
    "prefix + a ~43-token question (mount + fetch + suffix prefill in chunks of {step}; cold: "
    "the whole request); *restart* = process spawn → first token. Milliseconds unless marked, "
    "median (min–max). The KV is at most {kv_mb:.1f} MB, so these are the fixed costs of each "
    "cache kind's code path (restarts: mostly imports), not bandwidth: a regression there moves "
    "its row. Repetitions interleave across the rows too."
)


def classes_cell(classes: list[str]) -> str:
    """Layer cache classes, consecutive repeats collapsed: 'RotatingKVCache ×2, KVCache'."""
    runs: list[list[Any]] = []
    for c in classes:
        if runs and runs[-1][0] == c:
            runs[-1][1] += 1
        else:
            runs.append([c, 1])
    return ", ".join(c if n == 1 else f"{c} ×{n}" for c, n in runs)


def section(r: dict[str, Any]) -> list[str]:
    lines = ["## 8. Architectures (tiny models, issue 11)", ""]
    kv_mb = max((x["cache_bytes"] for x in r["rows"] if "cache_bytes" in x), default=0) / 1e6
    intro = ARCH_INTRO.format(dtype=r["dtype"], reps=r["reps"], step=r["step"], kv_mb=kv_mb)
    if r.get("workers", 1) > 1:
        intro += (
            f" (--quick: {r['workers']} architectures at a time, a smoke: not figures to compare.)"
        )
    lines += [intro, ""]
    ms = lambda s: cell({**s, **{k: s[k] * 1e3 for k in ("median", "min", "max")}})  # noqa: E731
    rows, failed = [], []
    for x in r["rows"]:
        if "error" in x:
            failed.append(x)
            continue
        c, b = x["cold"], x["bundle"]
        hit = "full" if x["full_hit"] else f"**{'/'.join(map(str, x['hit_tokens']))} tokens**"
        rows.append(
            [f"`{x['arch']}`", classes_cell(x["classes"]), x["tokens"], f"{x['cache_bytes']:,}"]
            + [ms(x["verified"]), ms(x["unchecked"]), f"**{x['mount_over_unchecked']:.2f}×**"]
            + [ms(c["after_load"]), ms(b["after_load"]), f"**{x['speedup_after_load']:.1f}×**"]
            + [cell(c["restart"]), cell(b["restart"]), f"{x['speedup_restart']:.2f}×"]
            + [x["verified"]["n"], f"{hit} / {'yes' if x['same_first_token'] else '**no**'}"]
        )
    header = ["architecture", "layer caches", "prefix tokens", "KV bytes", "verified mount"]
    header += ["unchecked load", "mount / unchecked", "cold after load", "bundle after load"]
    header += ["cold / bundle", "cold restart s", "bundle restart s", "cold / bundle", "n"]
    lines += table(header + ["bundle hit / same 1st token"], rows)
    for x in failed:
        error = " ".join(x["error"].split()).replace("|", "/")
        lines += [f"- **`{x['arch']}` failed:** `{error}`"]
    return lines + ([""] if failed else [])
