"""Case 6, incremental builds: a child that continues an earlier bundle vs a build from token 0.

Float32 bench model, chunks of STEP tokens, fidelity check off on both sides. A child continues
its parent's stored KV at the exact shared token (docs/bundle-format.md): its bytes differ from a
full build's in the last bits, and every child of one parent is the same bytes whatever proved
the parent. Each build is `pipeline.builder.builder.build` in a fresh process; the figure is its
wall time (model load, render, tokenize, prefill, write, hash), alternating full and incremental
runs.

Scenarios, from a base prefix of N tokens (parts A + B, A = 90 %):
- append: a new version with 5 % more text after it (A + B + D), parent = the base;
- sibling: another definition sharing the first 90 % (A + C), parent = the base.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from common import MODEL_F32, Context, ratio, run_worker, stat, text_with_tokens, write_definition

SYSTEM = "You are the assistant of a field team. Answer from these notes only.\nNotes:\n"


def settings(quick: bool) -> dict[str, Any]:
    return (
        {"sizes": [1024], "step": 256, "reps": {1024: 1}, "lean": []}
        if quick
        # lean sizes: the sibling only, one rep, its full build being the base's own (the same
        # token count and chunks): a 16k-token full build takes about 20 min on the 2-core machine
        else {"sizes": [4096, 16384], "step": 512, "reps": {4096: 2, 16384: 1}, "lean": [16384]}
    )


# how an incremental build trusts its parent (docs/deploy.md#incremental-builds-and-parents): the
# default for the builder's own parents and for signed ones costs no recompute; the spot checks
# are what a parent of unknown origin costs
POLICIES = {
    "built here (default)": {},
    "signed, --trusted-key": {"trusted_key": True},
    "--parent-check sample": {"parent_check": "sample", "foreign": True},
    "--parent-check chunks": {"parent_check": "chunks", "foreign": True},
}


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


def one_build(
    project: Path, name: str, bundles: str, incremental: bool, policy: dict[str, Any] | None = None
) -> dict[str, Any]:
    policy = policy or {}
    args = {
        "project": str(project),
        "name": name,
        "bundles": bundles,
        "check": False,
        "incremental": incremental,
    }
    env = {}
    if policy.get("trusted_key"):
        args["trusted_key"] = str(project / "release.pub")
    if "parent_check" in policy:
        args["parent_check"] = policy["parent_check"]
    if policy.get("foreign"):  # a parent this builder has no record of: an empty private cache
        foreign = project / "foreign-builder"
        shutil.rmtree(foreign, ignore_errors=True)
        env["PREFIX_BUNDLES_CACHE_DIR"] = str(foreign)
    return run_worker("build", args, **env)


def run(ctx: Context) -> dict[str, Any]:
    cfg = settings(ctx.quick)
    sizes = [one_size(ctx, tokens, cfg) for tokens in cfg["sizes"]]
    return {"step": cfg["step"], "sizes": sizes}


def one_size(ctx: Context, tokens: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """The base once (signed), then per scenario the full build and each parent policy's
    incremental build, alternating (A B B A ...)."""
    from pipeline.builder.signing import sign_bundle
    from pipeline.format.secret_key import generate

    project = ctx.work / f"incremental-{tokens}"
    shutil.rmtree(project, ignore_errors=True)
    for name, text in texts(tokens).items():
        msgs = [{"role": "system", "content": text}]
        write_definition(project, f"inc-{name}", MODEL_F32, msgs, prefill_step_size=cfg["step"])
    shared_bundles = str(project / "bundles")  # where the base lives: the incremental side
    ctx.note(f"incremental: building the {tokens}-token base")
    base = one_build(project, "inc-base", shared_bundles, incremental=False)
    key = generate()
    sign_bundle(Path(base["bundle"]), key)
    (project / "release.pub").write_text(key.public_key().file_text())
    rows = []
    lean = tokens in cfg["lean"]
    for scenario in ("sibling",) if lean else ("append", "sibling"):
        runs: dict[str, list[dict[str, Any]]] = {"full": []} | {p: [] for p in POLICIES}
        if lean:
            runs["full"].append(base)  # same token count and chunks as the sibling's full build
        for rep in range(cfg["reps"][tokens]):
            kinds = list(runs) if rep % 2 == 0 else list(reversed(runs))
            for kind in kinds:
                if lean and kind == "full":
                    continue
                ctx.note(f"incremental: {tokens} tokens, {scenario}, {kind}, rep {rep + 1}")
                full = kind == "full"
                # the full side builds where no parent exists; the incremental side next to the base
                bundles = str(project / f"full-{rep}") if full else shared_bundles
                build = one_build(project, f"inc-{scenario}", bundles, not full, POLICIES.get(kind))
                runs[kind].append(build)
        full = runs["full"]
        full_s = stat([r["build_seconds"] for r in full])
        every = [
            r
            for kind, kind_runs in runs.items()
            for r in kind_runs
            if not (lean and kind == "full")
        ]
        rows.append(
            {
                "scenario": scenario,
                "tokens": every[0]["tokens"],
                "full_is_base": lean,
                "full_build_s": full_s.as_dict(),
                "full_prefill_s": stat([r["prefill_seconds"] for r in full]).as_dict(),
                # every child of the one parent: the same bytes (the continuation is deterministic)
                "byte_identical": len({r["file_sha256"] for r in every if r["reused_tokens"]}) == 1,
                "policies": {kind: _policy_row(runs[kind], full_s.median) for kind in POLICIES},
            }
        )
    return {"base_tokens": base["tokens"], "rows": rows}


def _policy_row(runs: list[dict[str, Any]], full_median: float) -> dict[str, Any]:
    build_s = stat([r["build_seconds"] for r in runs])
    return {
        "reused_tokens": runs[0]["reused_tokens"],
        "checked": runs[0]["parent_checked"],
        "build_s": build_s.as_dict(),
        "prefill_s": stat([r["prefill_seconds"] for r in runs]).as_dict(),
        "parent_s": stat([r["parent_seconds"] for r in runs]).as_dict(),
        "ratio": ratio(build_s.median, full_median),
    }


GOALS = {"append": 0.15, "sibling": 0.25}  # incremental / full build time (issue 12, goal 4)


def section(r: dict[str, Any]) -> list[str]:
    """The RESULTS.md section."""
    from report import cell, table

    lines = [
        "## 6. Incremental builds (float32 model)",
        "",
        __doc__.split("\n\n", 1)[1].strip(),
        "",
        f"Chunks of {r['step']} tokens. Seconds, median (min–max). 'parent s' is the time to "
        "find, validate (read once; hashed unless the memo vouches for it) and prove the parent, "
        "within the build's time.",
        "",
    ]
    rows = []
    for size in r["sizes"]:
        for x in size["rows"]:
            rows.append(
                [
                    x["scenario"], x["tokens"],
                    "full: the base's build (same tokens)" if x.get("full_is_base") else "full (from token 0)",
                    "", cell(x["full_build_s"]),
                    cell(x["full_prefill_s"]), "", "", _identical(x),
                    x["full_build_s"]["n"],
                ]
            )  # fmt: skip
            for kind, y in x["policies"].items():
                goal = f" (goal ≤ {GOALS[x['scenario']]}×)" if kind in DEFAULT_POLICIES else ""
                rows.append(
                    [
                        "", "", kind, y["reused_tokens"], cell(y["build_s"]), cell(y["prefill_s"]),
                        cell(y["parent_s"]), f"**{y['ratio']:.2f}×**{goal}", "", y["build_s"]["n"],
                    ]
                )  # fmt: skip
    header = [
        "scenario", "tokens", "build", "reused", "build s", "prefill s", "parent s",
        "incremental / full", "children byte-identical", "n",
    ]  # fmt: skip
    checked = {k: y["checked"] for x in r["sizes"][0]["rows"][:1] for k, y in x["policies"].items()}
    notes = ["", "How each policy recorded its parent (manifest `parent.checked`):", ""]
    notes += [f"- {kind}: {how}" for kind, how in checked.items()]
    return lines + table(header, rows) + notes


DEFAULT_POLICIES = ("built here (default)", "signed, --trusted-key")


def _identical(x: dict[str, Any]) -> str:
    return "the policies' builds: yes" if x["byte_identical"] else "**NO**"


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for size in r["sizes"]:
        for x in size["rows"]:
            goal = GOALS[x["scenario"]]
            what = "5 % appended to" if x["scenario"] == "append" else "a sibling sharing 90 % of"
            for kind in DEFAULT_POLICIES:
                y = x["policies"][kind]
                out.append(
                    {
                        "target": f"incremental build ({kind}), {what} a {size['base_tokens']}-"
                        f"token prefix ≤ {goal}× a full build, cache file byte-identical",
                        "measured": f"{y['ratio']:.3f}×, byte-identical: "
                        f"{'yes' if x['byte_identical'] else 'NO'}",
                        "met": y["ratio"] <= goal and x["byte_identical"],
                    }
                )
    return out
