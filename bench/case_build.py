"""Case 1, build throughput: our builder vs `mlx_lm cache_prompt` on the same model and prompt.

Fresh processes: ours is `pipeline.builder.builder.build` (library call, fidelity check off, since
cache_prompt checks nothing), its rate the builder's own prefill timer; theirs is the real CLI,
its rate its own timer ("Processed N tokens (X tok/s)") once all N tokens are in the cache. Rows
run in alternating order (A B … B A) against order effects. A same-process A/B (one model, the
two prefill loops alternating on the same tokens) isolates the code from process-level noise.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from common import (
    MODEL_BF16,
    MODEL_F32,
    Context,
    ratio,
    run_worker,
    stat,
    text_with_tokens,
    timed_command,
    write_definition,
)
from common import target_row as _row  # noqa: E402
from report import cell, table  # noqa: E402

PROCESSED = re.compile(r"Processed\s+(\d+) tokens \(\s*([\d.]+) tok/s\)")
DEFAULT_BLAS = "as installed (mlx-cpu's own)"


def sizes(quick: bool) -> dict[str, Any]:
    """Prompt lengths and repetitions; the default install is ~10x slower: shorter prompt there."""
    if quick:
        return dict(
            same_tokens=128, default_tokens=32, reps=1, default_reps=1, ab_pairs=1, extras=False
        )
    return dict(
        same_tokens=512, default_tokens=192, reps=5, default_reps=3, ab_pairs=5, extras=True
    )


def run_ours(ctx: Context, model: Path, text: str, tag: str) -> dict[str, Any]:
    """pipeline.builder.builder.build on a definition whose one user message is `text`."""
    project = ctx.work / "build-throughput" / tag
    write_definition(project, tag, model, [{"role": "user", "content": text}])
    args = {
        "project": str(project),
        "name": tag,
        "bundles": str(project / "bundles"),
        "check": False,
    }
    r = run_worker("build", args)
    out = {"tokens": r["tokens"], "tok_s": r["prefill_tok_s"], "wall": r["process_seconds"]}
    return out | {"step": r["step"]}


def run_cache_prompt(ctx: Context, model: Path, text: str, openblas: str | None) -> dict[str, Any]:
    """The real CLI, `python -m mlx_lm cache_prompt`, prompt on stdin; OpenBLAS via LD_PRELOAD or not."""
    out = ctx.work / "build-throughput" / "cache_prompt.safetensors"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "mlx_lm", "cache_prompt", "--model", str(model), "--prompt", "-"]
    env = {"LD_PRELOAD": openblas} if openblas else {}
    wall, output = timed_command([*cmd, "--prompt-cache-file", str(out)], stdin=text, **env)
    found = [(int(n), float(rate)) for n, rate in PROCESSED.findall(output) if int(n) > 0]
    if len(found) < 2:
        raise RuntimeError(f"cache_prompt printed no chunk progress line: {output[-500:]}")
    out.unlink(missing_ok=True)
    # found[-1]: all N tokens (N-1 in chunks, then a 1-token step that also computes logits)
    return {
        "tokens": found[-1][0],
        "tok_s": found[-1][1],
        "chunk_tok_s": found[-2][1],
        "wall": wall,
    }


def variants(openblas: str, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of the table: key, who, model, BLAS label, cache_prompt's LD_PRELOAD, prompt, reps."""
    same, default = cfg["reps"], cfg["default_reps"]
    rows = [
        ("ours_f32", "ours", MODEL_F32, "OpenBLAS (ours, preloaded)", None, "same", same),
        (
            "cp_f32_openblas",
            "cp",
            MODEL_F32,
            "OpenBLAS (LD_PRELOAD, same library)",
            openblas,
            "same",
            same,
        ),
        (
            "ours_bf16",
            "ours",
            MODEL_BF16,
            "OpenBLAS (ours; computes in float32)",
            None,
            "default",
            default,
        ),
        ("cp_bf16_default", "cp", MODEL_BF16, DEFAULT_BLAS, None, "default", default),
    ]
    if cfg["extras"]:  # decomposition, once each: OpenBLAS alone, float32 alone, no code of ours
        rows += [
            ("cp_bf16_openblas", "cp", MODEL_BF16, "OpenBLAS (LD_PRELOAD)", openblas, "default", 1),
            ("cp_f32_default", "cp", MODEL_F32, DEFAULT_BLAS, None, "default", 1),
        ]
    keys = ("key", "who", "model", "blas", "openblas", "prompt", "reps")
    return [dict(zip(keys, row, strict=True)) for row in rows]


def one(ctx: Context, row: dict[str, Any], text: str) -> dict[str, Any]:
    if row["who"] == "ours":
        return run_ours(ctx, row["model"], text, row["key"].replace("_", "-"))
    return run_cache_prompt(ctx, row["model"], text, row["openblas"])


def summarize(row: dict[str, Any], got: list[dict[str, Any]]) -> dict[str, Any]:
    out = {
        "key": row["key"],
        "who": "pipeline.builder.builder.build"
        if row["who"] == "ours"
        else "mlx_lm cache_prompt (CLI)",
        "model_dtype": "float32" if row["model"] == MODEL_F32 else "bfloat16",
        "blas": row["blas"],
        "prompt": row["prompt"],
        "tokens": got[0]["tokens"],
        "tok_s": stat([g["tok_s"] for g in got]).as_dict(),
        "wall_s": stat([g["wall"] for g in got]).as_dict(),
    }
    if "step" in got[0]:
        out["step"] = got[0]["step"]
    if "chunk_tok_s" in got[0]:
        out["chunk_tok_s"] = stat([g["chunk_tok_s"] for g in got]).as_dict()
    return out


def same_process_ab(ctx: Context, text: str, pairs: int) -> dict[str, Any]:
    """Our prefill loop vs cache_prompt's (generate_step) in one process, same tokens, alternating."""
    ctx.note(f"build throughput: same-process A/B, {pairs} pairs")
    r = run_worker("prefill_ab", {"model": str(MODEL_F32), "text": text, "pairs": pairs})
    out = {k: stat(r[k]).as_dict() for k in ("ours", "theirs", "theirs_chunk")}
    out["tokens"], out["raw"] = r["tokens"], {k: r[k] for k in ("ours", "theirs", "theirs_chunk")}
    out["ratio"] = ratio(out["ours"]["median"], out["theirs"]["median"])
    return out


def run(ctx: Context, openblas: str) -> dict[str, Any]:
    """Alternating repetitions of every variant; medians and the target ratios."""
    cfg = sizes(ctx.quick)
    texts = {
        "same": text_with_tokens(MODEL_F32, cfg["same_tokens"] - 8, seed=11),
        "default": text_with_tokens(MODEL_F32, cfg["default_tokens"] - 8, seed=12),
    }
    rows = variants(openblas, cfg)
    runs: dict[str, list[dict[str, Any]]] = {r["key"]: [] for r in rows}
    for rep in range(max(r["reps"] for r in rows)):
        order = rows if rep % 2 == 0 else rows[::-1]
        for row in (r for r in order if rep < r["reps"]):
            ctx.note(f"build throughput: {row['key']} rep {rep + 1}")
            runs[row["key"]].append(one(ctx, row, texts[row["prompt"]]))
    table = [summarize(row, runs[row["key"]]) for row in rows]
    med = {t["key"]: t["tok_s"]["median"] for t in table}
    wall = {t["key"]: t["wall_s"]["median"] for t in table}
    return {
        "config": cfg,
        "rows": table,
        "ab": same_process_ab(ctx, texts["same"], cfg["ab_pairs"]),
        "ratio_same_blas": ratio(med["ours_f32"], med["cp_f32_openblas"]),
        "ratio_default": ratio(med["ours_bf16"], med["cp_bf16_default"]),
        "wall_ratio_same_blas": ratio(wall["cp_f32_openblas"], wall["ours_f32"]),
        "wall_ratio_default": ratio(wall["cp_bf16_default"], wall["ours_bf16"]),
    }


BUILD_INTRO = (
    "Ours = `pipeline.builder.builder.build` (library call in a fresh process, fidelity check off, since "
    "cache_prompt checks nothing; prefill chunks of {step}, its default). cache_prompt = the real CLI "
    "`python -m mlx_lm cache_prompt --model DIR --prompt - --prompt-cache-file F` (its chunks: "
    "2048). **prefill tok/s** = each tool's own prefill timer, model load excluded (cache_prompt: "
    "the time until all N tokens are in its cache: N-1 in chunks, then a 1-token step that also "
    "computes logits; its chunks-only rate is shown too). "
    "**process wall** = the whole process: imports, load, tokenize, prefill, save (ours also "
    "fingerprints, stability probes, sha256 + fsync of the bundle). Repetitions interleaved, "
    "in alternating order (A B … B A)."
)


def section(r: dict[str, Any]) -> list[str]:
    cfg = r["config"]
    step = next((x["step"] for x in r["rows"] if x.get("step")), "?")
    lines = ["## 1. Build throughput", "", BUILD_INTRO.format(step=step), ""]
    lines += [
        f"Prompt 'same' ≈ {cfg['same_tokens']} tokens. The default install is ~10× slower, so its "
        f"comparison uses a short prompt, 'default' ≈ {cfg['default_tokens']} tokens, for both rows.",
        "",
    ]
    rows = [
        [x["who"], x["model_dtype"], x["blas"], f"{x['prompt']} ({x['tokens']})"]
        + [cell(x["tok_s"], "{:.1f}"), x["tok_s"]["n"]]
        + [
            cell(x["chunk_tok_s"], "{:.1f}") if "chunk_tok_s" in x else "–",
            cell(x["wall_s"], "{:.1f}"),
        ]
        for x in r["rows"]
    ]
    header = ["who", "model dtype", "BLAS", "prompt (tokens)", "prefill tok/s", "n"]
    lines += table(header + ["cache_prompt chunks only tok/s", "process wall s"], rows)
    ab = r["ab"]
    return lines + [
        f"- same BLAS, same float32 model, fresh processes: ours / cache_prompt = "
        f"**{r['ratio_same_blas']:.2f}×** prefill rate (process wall: {r['wall_ratio_same_blas']:.2f}× "
        "faster)",
        f"- same BLAS, same process (one float32 model, the two prefill loops alternating on the "
        f"same {ab['tokens']} tokens after a warm-up pair, n={ab['ours']['n']}): ours "
        f"{cell(ab['ours'], '{:.1f}')} vs cache_prompt's loop {cell(ab['theirs'], '{:.1f}')} tok/s "
        f"(chunks only {cell(ab['theirs_chunk'], '{:.1f}')}) = **{ab['ratio']:.2f}×**",
        f"- each as installed by default, bench model as shipped (bfloat16): ours / cache_prompt = "
        f"**{r['ratio_default']:.1f}×** prefill rate (process wall: {r['wall_ratio_default']:.1f}× "
        "faster)",
        "",
    ]


def targets(b: dict[str, Any]) -> list[dict[str, Any]]:
    """The build targets with their measured values."""
    out: list[dict[str, Any]] = []
    same, ab, default = b["ratio_same_blas"], b["ab"]["ratio"], b["ratio_default"]
    label = "build ≥ 1.0× cache_prompt, same BLAS (float32 model)"
    out.append(_row(label + ", fresh CLI processes", f"{same:.2f}×", same >= 1.0))
    out.append(_row(label + ", same-process A/B of the loops", f"{ab:.2f}×", ab >= 1.0))
    label = "build ≥ 10× cache_prompt as installed by default (bfloat16 model)"
    out.append(_row(label, f"{default:.1f}×", default >= 10.0))
    return out
