"""Case 3, mount cost of the largest bundle: verified mount vs unchecked load_prompt_cache vs raw reads.

Every variant runs in a fresh process after the same imports, variants interleaved, page cache
warm for all (the file is read once before the series): this compares CPU work on the same bytes,
not disk speed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import HUGE_PAGES, MODEL_F32, Context, ratio, run_worker, stat, timed_command
from common import target_row as _row  # noqa: E402
from report import GB, cell, table  # noqa: E402

from pipeline.format.bundle_folder import SIGNATURE_FILE

VARIANTS = {
    "verified": "pipeline.runtime.mount, a restart: file already verified once (memo hit)",
    "verified_signed": "verified, given a trusted key: + the signature stage (manifest.json.minisig)",
    "verified_first": "pipeline.runtime.mount, first mount after a deploy: BLAKE3 of every byte",
    "unchecked": "mlx_lm load_prompt_cache + mx.eval (no checks)",
    "python_read": "Python open().read(): raw read into fresh memory",
    "read_prefaulted": "Python readinto() a buffer whose pages were touched before the timer",
    "sha256": "sha256 of the file (hashlib, 8 MiB chunks): the floor of any sha256-verified read",
    "blake3_in_memory": "BLAKE3 (all cores) of the file's bytes already in memory: the hash part",
    "verified_first_hugepages": "verified_first, GLIBC_TUNABLES=glibc.malloc.hugetlb=1",
    "unchecked_hugepages": "unchecked, GLIBC_TUNABLES=glibc.malloc.hugetlb=1",
    "cat": "cat cache.safetensors > /dev/null (128 KiB buffer reused: no page faults)",
    "verified_phases": "mount_one's steps timed one by one (breakdown below)",
}
RSS_VARIANTS = ("verified", "verified_first", "unchecked", "python_read")


def reps(quick: bool) -> int:
    return 1 if quick else 4


def one(variant: str, bundle: Path, nbytes: int, trusted_key: Path | None = None) -> dict[str, Any]:
    """Seconds (and peak RSS above baseline) of one variant in a fresh process."""
    path = bundle / "cache.safetensors"
    if variant == "cat":
        seconds, _ = timed_command(["sh", "-c", f"cat '{path}' > /dev/null"])
        return {"seconds": seconds}
    base = variant.removesuffix("_hugepages")
    args = {"variant": base, "model": str(MODEL_F32), "bundle": str(bundle), "nbytes": nbytes}
    if variant == "verified_signed":
        args["trusted_key"] = str(trusted_key)
    r = run_worker("mount", args, **(HUGE_PAGES if base != variant else {}))
    out = {"seconds": r["seconds"], "phases": r.get("phases"), "faults": r["faults"]}
    if variant in RSS_VARIANTS:
        out["rss_above_baseline"] = r["rss_peak"] - r["rss_baseline"]
    return out


def run(ctx: Context, bundle: dict[str, Any]) -> dict[str, Any]:
    """Interleaved repetitions of every variant on one bundle."""
    path = Path(bundle["bundle"])
    nbytes = (path / "cache.safetensors").stat().st_size
    timed_command(
        ["sh", "-c", f"cat '{path / 'cache.safetensors'}' > /dev/null"]
    )  # warm the page cache
    variants = [v for v in VARIANTS if not (ctx.quick and v == "verified_phases")]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    trusted_key, signature_ms = sign_for_bench(path)  # removed again below
    try:
        for rep in range(reps(ctx.quick)):
            for variant in variants:
                ctx.note(f"mount cost: {variant} rep {rep + 1}")
                runs[variant].append(one(variant, path, nbytes, trusted_key))
    finally:
        (path / SIGNATURE_FILE).unlink(missing_ok=True)
        trusted_key.unlink(missing_ok=True)
    rows = {}
    for variant, got in runs.items():
        row = {"what": VARIANTS[variant], "seconds": stat([g["seconds"] for g in got]).as_dict()}
        if "rss_above_baseline" in got[0]:
            rss = stat([g["rss_above_baseline"] for g in got])
            row["rss_above_baseline"] = rss.as_dict()
            row["rss_over_bundle"] = rss.median / nbytes
        row["gb_per_s"] = nbytes / row["seconds"]["median"] / 1e9
        if "faults" in got[0]:
            row["faults"] = stat([g["faults"] for g in got]).median
        if got[0].get("phases"):
            names = got[0]["phases"]
            row["phases"] = {k: stat([g["phases"][k] for g in got]).as_dict() for k in names}
        rows[variant] = row
    med = {v: r["seconds"]["median"] for v, r in rows.items()}
    return {
        "bundle": str(path),
        "length": bundle["length"],
        "tokens": bundle["tokens"],
        "cache_bytes": nbytes,
        "rows": rows,
        "verified_over_unchecked": ratio(med["verified"], med["unchecked"]),
        "verified_over_cat": ratio(med["verified"], med["cat"]),
        "first_over_unchecked": ratio(med["verified_first"], med["unchecked"]),
        "first_over_cat": ratio(med["verified_first"], med["cat"]),
        "verified_over_python_read": ratio(med["verified"], med["python_read"]),
        "unchecked_over_cat": ratio(med["unchecked"], med["cat"]),
        "first_hp_over_unchecked_hp": ratio(
            med["verified_first_hugepages"], med["unchecked_hugepages"]
        ),
        "first_hp_over_cat": ratio(med["verified_first_hugepages"], med["cat"]),
        "first_floor_over_unchecked": ratio(
            med["unchecked"] + med["blake3_in_memory"], med["unchecked"]
        ),
        "python_read_over_prefaulted": ratio(med["python_read"], med["read_prefaulted"]),
        "signed_minus_verified_ms": (med["verified_signed"] - med["verified"]) * 1000,
        "signature_check_ms": signature_ms,
    }


def sign_for_bench(bundle: Path) -> tuple[Path, dict[str, float]]:
    """Sign the bundle with a fresh key (its public key file returned), and time the signature
    stage alone in this process: read manifest.json, verify, parse, check the trusted comment."""
    import time

    from pipeline.builder.signing import sign_manifest
    from pipeline.format.bundle_folder import parse_manifest, read_manifest_bytes
    from pipeline.format.bundle_signature import check_binding, check_signature
    from pipeline.format.secret_key import generate

    key = generate()
    sign_manifest(bundle, key)
    public = bundle.parent / f".bench-{bundle.name}.pub"
    public.write_text(key.public_key().file_text())
    times = []
    for _ in range(200):
        start = time.perf_counter()
        data = read_manifest_bytes(bundle, None)
        sig = check_signature(bundle, data, [key.public_key()])
        check_binding(bundle, sig, parse_manifest(bundle, data))
        times.append((time.perf_counter() - start) * 1000)
    return public, stat(times).as_dict()


PHASES = ("fingerprints", "validate_and_load")  # mount_one's order


def section(r: dict[str, Any]) -> list[str]:
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


def targets(m: dict[str, Any]) -> list[dict[str, Any]]:
    """The mount targets (issue 5) with their measured values."""
    out: list[dict[str, Any]] = []
    at = f"{m['tokens']}-token bundle" + (
        " (quick; target is for 4k)" if m["length"] < 4096 else ""
    )
    for key, when in (
        ("verified", "restart (memo hit)"),
        ("first", "first mount after deploy"),
    ):
        over_unchecked, over_cat = m[f"{key}_over_unchecked"], m[f"{key}_over_cat"]
        out.append(
            _row(
                f"verified mount ≤ 1.1× unchecked load_prompt_cache — {when}",
                f"{over_unchecked:.2f}× ({at})",
                over_unchecked <= 1.1,
            )
        )
        out.append(
            _row(
                f"verified mount ≤ 2× raw read (cat) — {when}",
                f"{over_cat:.2f}× ({at})",
                over_cat <= 2.0,
            )
        )
    if "first_hp_over_cat" in m:
        hp_unchecked, hp_cat = m["first_hp_over_unchecked_hp"], m["first_hp_over_cat"]
        label = "first mount after deploy, huge pages (serve --huge-pages on)"
        out.append(
            _row(
                f"verified mount ≤ 1.1× unchecked load_prompt_cache — {label}",
                f"{hp_unchecked:.2f}× ({at})",
                hp_unchecked <= 1.1,
            )
        )
        out.append(
            _row(
                f"verified mount ≤ 2× raw read (cat) — {label}",
                f"{hp_cat:.2f}× ({at})",
                hp_cat <= 2.0,
            )
        )
    restart, first = (m["rows"][k]["rss_over_bundle"] for k in ("verified", "verified_first"))
    out.append(
        _row(
            "mount peak memory ≤ 1.2× bundle bytes above baseline",
            f"{restart:.2f}× (restart), {first:.2f}× (first mount)",
            max(restart, first) <= 1.2,
        )
    )
    return out
