"""RESULTS.md sections from the measurements (no measuring here)."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
from importlib.metadata import version
from pathlib import Path
from typing import Any

from case_mount import VARIANTS
from common import REPO

GB = 1e9
MACHINE_KEYS = ("cpu", "cores", "memory", "os", "python", "mlx", "mlx-lm", "pipeline", "openblas")


def machine(openblas: str | None) -> dict[str, str]:
    """CPU, cores, memory, versions."""
    import pipeline

    info = _proc_first("/proc/cpuinfo", "model name")
    kib = _proc_first("/proc/meminfo", "MemTotal")
    return {
        "cpu": f"{info or 'unknown'} ({platform.machine()})",
        "cores": str(os.cpu_count()),
        "memory": f"{int(kib.split()[0]) / 2**20:.1f} GiB" if kib else "unknown",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "mlx": version("mlx"),
        "mlx-lm": version("mlx-lm"),
        "pipeline": f"{pipeline.__version__} (git {git_rev()})",
        "openblas": blas_config(openblas),
    }


def _proc_first(path: str, key: str) -> str | None:
    if not Path(path).is_file():
        return None
    for line in Path(path).read_text().splitlines():
        if line.startswith(key):
            return line.split(":", 1)[1].strip()
    return None


def git_rev() -> str:
    """Short commit of the tree measured, marked when pipeline/ had uncommitted changes."""
    run = lambda *a: subprocess.run(a, cwd=REPO, capture_output=True, text=True).stdout.strip()  # noqa: E731
    try:
        dirty = run("git", "status", "--porcelain", "pipeline")
        return run("git", "rev-parse", "--short", "HEAD") + (
            " + uncommitted pipeline/" if dirty else ""
        )
    except OSError:
        return "unknown"


def blas_config(path: str | None) -> str:
    if not path:
        return "none found"
    try:
        lib = ctypes.CDLL(path)
        lib.openblas_get_config.restype = ctypes.c_char_p
        return f"{path} ({lib.openblas_get_config().decode()})"
    except (OSError, AttributeError):
        return path


def cell(s: dict[str, float], fmt: str = "{:.3g}") -> str:
    """'median (min–max)' of a stat dict; the value alone when n == 1."""
    if s["n"] == 1:
        return fmt.format(s["median"])
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}–{fmt.format(s['max'])})"


def heading(title: str, doc: str) -> list[str]:
    """A case's RESULTS.md section opening: its title, then its module docstring past the first
    paragraph (what the case measures)."""
    return [f"## {title}", "", doc.split("\n\n", 1)[1].strip(), ""]


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """A markdown table."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out + [""]


def fidelity(f: dict[str, Any]) -> list[str]:
    """[max |dlogit|, greedy match] cells of a manifest's fidelity record."""
    if not f.get("checked"):
        return ["not checked", "–"]
    return [f"{f['max_abs_logit_diff']:.3g}", "yes" if f["greedy_match"] else "no"]


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


def build_section(r: dict[str, Any]) -> list[str]:
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


TTFT_INTRO = (
    "A fresh process imports, loads the model (`mlx_lm.load`), then mounts the prefix's bundle "
    "(`pipeline.runtime.mount` into a `PromptCacheManager`) or not (cold), renders the request "
    "(prefix + one user question) with the model's chat template, fetches from the manager, "
    "prefills what the cache lacks in chunks of {step} (both paths) and takes the greedy first "
    "token. OpenBLAS preloaded in both; page cache warm. Seconds, median (min–max). *restart* = "
    "process spawn → first token; *after load* = model loaded → first token (mount + request: "
    "the part a bundle changes); *request* = startup done (mount included in startup) → first token."
)


def ttft_section(r: dict[str, Any], builds: list[dict[str, Any]]) -> list[str]:
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


PHASES = ("fingerprints", "validate_and_load")  # mount_one's order


def mount_section(r: dict[str, Any]) -> list[str]:
    lines = [
        f"## 3. Mount cost ({r['tokens']}-token bundle, {r['cache_bytes'] / GB:.3f} GB cache.safetensors)",
        "",
        "Each variant in a fresh process after identical imports, interleaved; page cache warm for "
        "all (the file was read once before the series), so this is CPU work on the same bytes.",
        "",
    ]
    rows = [
        [k, v["what"], cell(v["seconds"]), v["seconds"]["n"], f"{v['gb_per_s']:.2f}"]
        + [f"{v['faults']:,.0f}" if "faults" in v else "–"]
        + [f"{v['rss_over_bundle']:.2f}×" if "rss_over_bundle" in v else "–"]
        for k, v in ((k, r["rows"][k]) for k in VARIANTS if k in r["rows"])
    ]
    header = ["variant", "what", "seconds", "n", "GB/s", "page faults"]
    lines += table(header + ["peak RSS above baseline / bytes"], rows)
    phases = r["rows"].get("verified_phases", {}).get("phases", {})
    if phases:
        lines.append(
            "Verified mount, step by step (median s): "
            + ", ".join(f"{k} {phases[k]['median']:.4f}" for k in PHASES if k in phases)
        )
        lines.append("")
    return (
        lines
        + [
            f"- verified / unchecked load_prompt_cache = **{r['verified_over_unchecked']:.2f}×** "
            f"(first mount after deploy: **{r['first_over_unchecked']:.2f}×**); "
            f"verified / cat = **{r['verified_over_cat']:.2f}×** (first: {r['first_over_cat']:.2f}×); "
            f"verified / Python read = "
            f"{r['verified_over_python_read']:.2f}×; unchecked / cat = {r['unchecked_over_cat']:.2f}×; "
            f"Python read / prefaulted read = {r['python_read_over_prefaulted']:.2f}×",
        ]
        + (
            [
                f"- first mount's floor on this machine, an unchecked load plus BLAKE3 of the bytes "
                f"in memory, one after the other (2 cores: the two cannot overlap): "
                f"**{r['first_floor_over_unchecked']:.2f}×** unchecked; with huge pages, first mount "
                f"/ unchecked (both with huge pages) = **{r['first_hp_over_unchecked_hp']:.2f}×**, "
                f"first mount / cat = **{r['first_hp_over_cat']:.2f}×**",
                "",
            ]
            if "first_hp_over_cat" in r
            else [""]
        )
        + _signature_lines(r)
    )


def _signature_lines(r: dict[str, Any]) -> list[str]:
    """The signature stage's cost (issue 18: under 5 ms per mount)."""
    if "signature_check_ms" not in r:
        return []
    alone = r["signature_check_ms"]
    return [
        f"- signature stage (given a trusted key): verified_signed - verified = "
        f"**{r['signed_minus_verified_ms']:+.1f} ms** (medians, fresh processes); the stage alone "
        f"in one process (read manifest.json, verify, parse, check the trusted comment): "
        f"**{alone['median']:.2f} ms** median of {alone['n']} (target: under 5 ms)",
        "",
    ]


def sizes_section(r: dict[str, Any]) -> list[str]:
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


def memory_section(m: dict[str, Any]) -> list[str]:
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


def targets_section(targets: list[dict[str, Any]]) -> list[str]:
    rows = [[t["target"], t["measured"], "yes" if t["met"] else "**no**"] for t in targets]
    return ["## Targets (issues 5 and 12)", ""] + table(["target", "measured", "met"], rows)


def handout_section(h: dict[str, Any] | None) -> list[str]:
    lines = [
        "## 7. Hand-out and first decode step (`bench/bench_handout.py`, `bench/frozen_base.py`)",
        "",
    ]
    if h is None:
        return lines + [
            "HOOK: `bench/bench_handout.py` (`run(quick) -> dict`) not found; nothing ran.",
            "",
        ]
    lines += [h.get("markdown") or f"```\n{h['result']}\n```", ""]
    if h.get("hugepages"):
        lines += [
            "The same, in a process started with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` "
            "(`serve --huge-pages on`):",
            "",
            h["hugepages"]["markdown"],
            "",
        ]
    if h.get("frozen_base"):
        lines += [h["frozen_base"]["markdown"], ""]
    return lines


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


def arch_section(r: dict[str, Any]) -> list[str]:
    lines = ["## 8. Architectures (tiny models, issue 11)", ""]
    kv_mb = max((x["cache_bytes"] for x in r["rows"] if "cache_bytes" in x), default=0) / 1e6
    intro = ARCH_INTRO.format(dtype=r["dtype"], reps=r["reps"], step=r["step"], kv_mb=kv_mb)
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
