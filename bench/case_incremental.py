"""Case 6, incremental builds: a rebuild that starts from an earlier bundle vs one from token 0.

Float32 bench model (the prefill's dtype is the serving dtype, so a stored cache is the prefill's
own state and can be resumed byte-identically), chunks of STEP tokens, fidelity check off on both
sides (the check's serving-path comparison re-prefills from token 0 when the chunks differ from
mlx_lm.server's 2048). Each build is `pipeline.builder.builder.build` in a fresh process; the
figure is its wall time (model load, render, tokenize, prefill, write, hash), alternating full
and incremental runs.

Scenarios, from a base prefix of N tokens (parts A + B, A = 90 %):
- append: a new version with 5 % more text after it (A + B + D), parent = the base;
- sibling: another definition sharing the first 90 % (A + C), parent = the base.
"""

from __future__ import annotations

from typing import Any

from common import MODEL_F32, Context, ratio, run_worker, stat, text_with_tokens, write_definition

SYSTEM = "You are the assistant of a field team. Answer from these notes only.\nNotes:\n"


def settings(quick: bool) -> dict[str, int]:
    return (
        {"tokens": 1024, "step": 256, "reps": 1}
        if quick
        else {"tokens": 4096, "step": 512, "reps": 2}
    )


def texts(tokens: int) -> dict[str, str]:
    """The system texts of the base, the appended version and the sibling."""
    shared = text_with_tokens(MODEL_F32, int(tokens * 0.9), seed=11)
    tail = text_with_tokens(MODEL_F32, tokens - int(tokens * 0.9), seed=12)
    other_tail = text_with_tokens(MODEL_F32, tokens - int(tokens * 0.9), seed=13)
    more = text_with_tokens(MODEL_F32, int(tokens * 0.05), seed=14)
    return {
        "base": SYSTEM + shared + "\n" + tail,
        "append": SYSTEM + shared + "\n" + tail + "\n" + more,
        "sibling": SYSTEM + shared + "\n" + other_tail,
    }


def one_build(ctx: Context, name: str, bundles: str, incremental: bool) -> dict[str, Any]:
    project = ctx.work / "incremental"
    return run_worker(
        "build",
        {
            "project": str(project),
            "name": name,
            "bundles": bundles,
            "check": False,
            "incremental": incremental,
        },
    )


def run(ctx: Context) -> dict[str, Any]:
    """The base once, then each scenario full and incremental, alternating (A B B A ...)."""
    cfg = settings(ctx.quick)
    project = ctx.work / "incremental"
    for name, text in texts(cfg["tokens"]).items():
        msgs = [{"role": "system", "content": text}]
        write_definition(project, f"inc-{name}", MODEL_F32, msgs, prefill_step_size=cfg["step"])
    shared_bundles = str(project / "bundles")  # where the base lives: the incremental side
    ctx.note("incremental: building the base")
    base = one_build(ctx, "inc-base", shared_bundles, incremental=False)
    rows = []
    for scenario in ("append", "sibling"):
        runs: dict[str, list[dict[str, Any]]] = {"full": [], "incremental": []}
        for rep in range(cfg["reps"]):
            order = ("full", "incremental") if rep % 2 == 0 else ("incremental", "full")
            for kind in order:
                ctx.note(f"incremental: {scenario}, {kind} rep {rep + 1}")
                # the full side builds where no parent exists; the incremental side next to the base
                bundles = shared_bundles if kind == "incremental" else str(project / f"full-{rep}")
                runs[kind].append(
                    one_build(ctx, f"inc-{scenario}", bundles, incremental=kind == "incremental")
                )
        full, inc = runs["full"], runs["incremental"]
        rows.append(
            {
                "scenario": scenario,
                "tokens": full[0]["tokens"],
                "reused_tokens": inc[0]["reused_tokens"],
                "full_build_s": stat([r["build_seconds"] for r in full]).as_dict(),
                "incremental_build_s": stat([r["build_seconds"] for r in inc]).as_dict(),
                "full_prefill_s": stat([r["prefill_seconds"] for r in full]).as_dict(),
                "incremental_prefill_s": stat([r["prefill_seconds"] for r in inc]).as_dict(),
                "byte_identical": len({r["file_sha256"] for r in full + inc}) == 1,
                "ratio": ratio(
                    stat([r["build_seconds"] for r in inc]).median,
                    stat([r["build_seconds"] for r in full]).median,
                ),
            }
        )
    return {"base_tokens": base["tokens"], "step": cfg["step"], "rows": rows}


GOALS = {"append": 0.15, "sibling": 0.25}  # incremental / full build time (issue 12, goal 4)


def section(r: dict[str, Any]) -> list[str]:
    """The RESULTS.md section."""
    from report import cell, table

    lines = [
        "## 6. Incremental builds (float32 model)",
        "",
        __doc__.split("\n\n", 1)[1].strip(),
        "",
        f"Base: {r['base_tokens']} tokens; chunks of {r['step']} tokens. Seconds, median (min–max).",
        "",
    ]
    rows = [
        [
            x["scenario"],
            x["tokens"],
            x["reused_tokens"],
            cell(x["full_build_s"]),
            cell(x["incremental_build_s"]),
            cell(x["full_prefill_s"]),
            cell(x["incremental_prefill_s"]),
            f"**{x['ratio']:.2f}×** (goal ≤ {GOALS[x['scenario']]}×)",
            "yes" if x["byte_identical"] else "**NO**",
            x["full_build_s"]["n"],
        ]
        for x in r["rows"]
    ]
    header = [
        "scenario", "tokens", "reused", "full build s", "incremental build s", "full prefill s",
        "incremental prefill s", "incremental / full", "cache file byte-identical", "n",
    ]  # fmt: skip
    return lines + table(header, rows)


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for x in r["rows"]:
        goal = GOALS[x["scenario"]]
        what = "5 % appended to" if x["scenario"] == "append" else "a sibling sharing 90 % of"
        out.append(
            {
                "target": f"incremental build, {what} a {r['base_tokens']}-token prefix ≤ {goal}× "
                "a full build, cache file byte-identical",
                "measured": f"{x['ratio']:.2f}×, byte-identical: {'yes' if x['byte_identical'] else 'NO'}",
                "met": x["ratio"] <= goal and x["byte_identical"],
            }
        )
    return out
