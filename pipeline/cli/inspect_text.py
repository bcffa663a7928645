"""`inspect` for people: what a bundle holds, its files and each check as aligned tables, a check
that was not made shown as not made, and the next command to run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.cli.common import say

NO_KEY = "not checked: no --trusted-key given"
NO_HOST_KEY = (
    "not checked: a snapshot is signed with its host's snapshot key, which inspect does not read "
    "(serve mounts it only where that key verifies it: docs/signing.md)"
)
NO_MODEL = "not checked: no --model given (the recorded fingerprints were compared with nothing)"
REBUILT = {"files", "checksums", "manifest", "cache file", "layout", "tokens", "data"}
NA = "n/a"  # an optional manifest field the file leaves null


def print_inspect(
    bundle: Path, manifest: Any, args: Any, identity: Any, refusal: Any, keys: tuple, kind: str
):
    """The whole text report: summary, files, checks, verdict and the next command; `kind`: what
    the folder was checked as (by where it is, not by what its manifest says)."""
    say(f"{'snapshot' if kind == 'snapshot' else 'bundle'} {bundle}")
    data = manifest.model_dump(mode="json")
    _print_rows(summary_rows(data))
    if data.get("parent"):  # an incremental build: which bundle's cache it started from
        say(f"  parent: {parent_line(data['parent'])}")
        if data["parent"].get("checked"):
            say(f"  parent checked: {data['parent']['checked']}")
    say(f"  signature: {_signature_line(bundle)}")
    print_files(bundle)
    _print_checks(manifest, args, identity, refusal, keys, kind)
    model = getattr(args, "model", None)
    scope = f" for {model}" if model else " (integrity only)"
    if kind == "snapshot" and not keys:
        scope += ", host signature not checked"
    say(f"valid{scope}: {'yes' if refusal is None else 'no'}")
    say(f"next: {next_step(bundle, manifest, model, refusal, bool(keys))}")


def _depends_cell(sources: list | None) -> str:
    """What a snapshot is served only with: the bundles it may continue, by manifest digest."""
    if sources is None:
        return "not recorded (format 3): serve does not restore it"
    if not sources:
        return "no bundle (the server computed it from token 0)"
    each = [f"{s['bundle']} (manifest sha256 {s['manifest_sha256'][:16]}..)" for s in sources]
    return ", ".join(each) + ": restored only while each is mounted and trusted"


def summary_rows(data: dict) -> list[tuple[str, str]]:
    """(label, value) rows of what the manifest says, short digests; `--json` has every field."""
    rows = []
    if data.get("prefix"):
        p = data["prefix"]
        rows.append(
            ("prefix", f"{p['name']}@{p['version']}, content sha256 {p['content_sha256'][:16]}..")
        )
    if data.get("snapshot"):
        record = {k: v for k, v in data["snapshot"].items() if k != "depends_on"}
        rows.append(("snapshot", ", ".join(f"{k}={_or_na(v)}" for k, v in record.items())))
        rows.append(("depends on", _depends_cell(data["snapshot"].get("depends_on"))))
    t = data["tokens"]
    stable = (
        "all stable"
        if t["stable_tokens"] == t["rendered_tokens"] == t["count"]
        else f"stable {t['stable_tokens']:,} of {t['rendered_tokens']:,} rendered"
    )
    rows.append(("tokens", f"{t['count']:,} ({stable}), ids sha256 {t['ids_sha256'][:16]}.."))
    rows.append(("model", _model_cell(data["model"])))
    rows.append(("cache", _cache_cell(data["cache"])))
    rows.append(("fidelity", _fidelity_cell(data["fidelity"])))
    b = data["builder"]
    rows.append(
        ("builder", f"pipeline {b['pipeline']}, mlx {b['mlx']}, mlx-lm {b['mlx_lm']}, "
                    f"{b['device']}, {b['compute_dtype']} compute")
    )  # fmt: skip
    if data.get("text"):
        x = data["text"]
        rows.append(("text", f"{x['chars']:,} chars, sha256 {x['sha256'][:16]}.."))
        rows.append(("preview", json.dumps(x["preview"], ensure_ascii=False)))
    if data.get("build_key"):
        rows.append(("build key", data["build_key"]))
    return rows


def _model_cell(m: dict) -> str:
    template = m.get("template_sha256")
    how = f" ({m['template_source']}'s)" if m.get("template_source") else ""
    pinned = f", template {template[:16]}..{how}" if template else ", no template"
    return (
        f"{m['slug']}, fingerprint {m['fingerprint'][:16]}.., tokenizer "
        f"{m['tokenizer_fingerprint'][:16]}..{pinned}"
    )


def _cache_cell(c: dict) -> str:
    classes = c["classes"]
    kinds = sorted(set(classes), key=classes.index)
    each = ", ".join(f"{classes.count(k)} x {k}" for k in kinds)
    bits = (
        f"{c['kv_bits']}-bit KV (group {c['kv_group_size']})"
        if c["kv_bits"]
        else "KV not quantized"
    )
    layout = f", layout {c['layout']}" if c.get("layout") else ""
    return (
        f"{len(classes)} layers ({each}), {c['dtype']}, {bits}, chunks of "
        f"{c['prefill_step_size']:,}{layout}, {size(c['file_bytes'])}"
    )


def _fidelity_cell(f: dict) -> str:
    if not f.get("checked"):
        return "not checked at build"
    return _fidelity(f["max_abs_logit_diff"], f["threshold"], f["greedy_match"])


def _fidelity(diff: float | None, threshold: float | None, greedy: bool | None) -> str:
    """The build's check; a field the manifest leaves null (the schema allows it) as n/a."""
    return (
        f"max |logit diff| {_num(diff, '.3g')} <= {_num(threshold, 'g')}, "
        f"greedy match {_or_na(greedy)}"
    )


def _num(x: float | None, spec: str) -> str:
    return NA if x is None else format(x, spec)


def _or_na(x: Any) -> str:
    return NA if x is None else str(x)


def size(n: int) -> str:
    """'164 B', '24.4 KiB', '21.6 MiB', '1.2 GiB'."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):,.1f} {unit}"
    return f"{n} B"


def _print_rows(rows: list[tuple[str, str]]) -> None:
    """`  label:  value`, the values aligned (labels are at most 'signature:' wide)."""
    for label, value in rows:
        say(f"  {label + ':':<11}{value}")


def print_files(bundle: Path) -> None:
    """The folder's files: name, bytes, size; which are outside the checksums."""
    files = [p for p in sorted(bundle.iterdir()) if p.is_file()]
    rows = [("file", "bytes", "size", "")]
    for p in files:
        n = p.stat().st_size
        outside = "informational, outside the checksums" if p.name == "build-report.json" else ""
        rows.append((p.name, f"{n:,}", size(n), outside))
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    say("files:")
    for name, n, human, why in rows:
        say(f"  {name:<{w[0]}}  {n:>{w[1]}}  {human:<{w[2]}}  {why}".rstrip())


def _print_checks(manifest, args: Any, identity, refusal, keys: tuple, kind: str) -> None:
    """The validator's stages in order: ok up to the one that refused, which says why; a check
    that was not made (no --model, no --trusted-key) as not made."""
    from pipeline.format.identity import identity_checks
    from pipeline.format.validate import CHECKS

    model = getattr(args, "model", None)
    target = f" for model {model}" if model else " (integrity only: no --model given)"
    say(f"checks{target}:")
    say(f"  {'stat':<4} {'check':<21} detail")
    failed = refusal.check if refusal is not None else None
    reached = True
    for name, detail in CHECKS:
        if name == "identity" and model and reached:
            for c in identity_checks(manifest, identity):
                line = f"{(c.found or 'none')[:16]}.. matches" if c.ok else c.error(Path("")).reason
                say(f"  {'ok  ' if c.ok else 'FAIL'} {c.what:<21} {line}")
        elif name == "identity" and not model and reached and failed != name:
            say(f"  --   {name:<21} {NO_MODEL}")
        elif name == "signature" and not keys and reached:
            say(f"  --   {name:<21} {NO_HOST_KEY if kind == 'snapshot' else NO_KEY}")
        elif name == failed:
            say(f"  FAIL {name:<21} {refusal.reason}")
        elif reached:
            say(f"  ok   {name:<21} {detail}")
        else:
            say(f"  --   {name:<21} not reached")
        reached = reached and name != failed
    _print_info(manifest)


def _print_info(manifest) -> None:
    t, f = manifest.tokens, manifest.fidelity
    if manifest.kind == "snapshot":  # a server's own entry: no rendering, probes or build check
        return
    say(
        f"  info stability              {t.stable_tokens}/{t.rendered_tokens} rendered tokens are a prefix of every probe turn"
    )
    if f.checked:
        fidelity = _fidelity(f.max_abs_logit_diff, f.threshold, f.greedy_match)
        say(f"  info fidelity               {fidelity} (at build, vs {_or_na(f.reference)})")
        say(f"  info serving path           {_serving(f)}")
        say(f"  info reuse rule             {_reuse_rule(manifest)}")


def next_step(bundle: Path, manifest, model: Path | None, refusal, with_keys: bool) -> str:
    """The one command to run next: the fix for a refusal, else the check not made yet."""
    name = manifest.prefix.name if manifest.prefix is not None else None
    stage = refusal.check if refusal is not None else None
    if stage == "identity" and name:
        return f"build it for this model: prefix-bundles build {name} --model {model}"
    if stage in REBUILT and name:
        return f"rebuild it: prefix-bundles build {name} --force (or copy it again from its source)"
    if stage == "signature":
        return (
            f"sign it with a key you trust: prefix-bundles sign {bundle} --key FILE, or pass "
            "the --trusted-key that signed it"
        )
    if stage is not None:
        return "fix what the failed check says above, then run this command again"
    if model is None:
        return f"compare its fingerprints with the model you serve: prefix-bundles inspect {bundle} --model DIR"
    if manifest.kind == "snapshot":  # DIR/set-N/<rank>-<id>: serve restores DIR's newest set
        folder = Path(bundle).parent.parent
        return f"serve restores it on its host: prefix-bundles serve --model {model} --snapshots {folder}"
    if not with_keys and (bundle / "manifest.json.minisig").is_file():
        return f"check its signature: prefix-bundles inspect {bundle} --model {model} --trusted-key FILE"
    return f"serve it: prefix-bundles serve --model {model} --bundles {_bundles_root(bundle)}"


def _bundles_root(bundle: Path) -> Path:
    """The bundles folder serve scans: <root>/<name>/<version>/<model folder>."""
    parents = Path(bundle).parents
    return parents[2] if len(parents) > 2 else Path(bundle).parent


def _signature_line(bundle: Path) -> str:
    """Who signed the bundle and the trusted comment, as written (the checks below verify it)."""
    from pipeline.format.bundle_signature import describe

    info = describe(bundle)
    if info is None:
        return "none (unsigned)"
    if info.problem is not None:
        return f"unreadable: {info.problem}"
    return f"key id {info.key_id}, trusted comment {info.trusted_comment!r}"


def _serving(f) -> str:
    """The serving-path comparison: measured, inherited from a parent (a child), or why not."""
    if f.serving is not None:
        return _serving_check(f.serving)
    if f.inherited is not None:
        i = f.inherited
        return (
            f"inherited from {i.bundle} (its stored positions are this bundle's first "
            f"{i.tokens:,}): {_serving_check(i.serving)}"
        )
    return _or_na(f.serving_skipped)


def _serving_check(s) -> str:
    return (
        f"max |logit diff| {s.max_abs_logit_diff:.3g} vs a cold {s.dtype} prefill on {s.device} "
        f"(chunks of {s.chunk_tokens}), greedy match {s.greedy_match}"
        + (", a tie within tolerance" if s.tie_within_tolerance else "")
    )


def _reuse_rule(manifest) -> str:
    """What the runtime lets a request take from this bundle, and the error measured there."""
    if manifest.cache.kv_bits is None:
        return "exact: any shared prefix is reused (at least one token left to process)"
    short = manifest.fidelity.shortest_reuse
    if short is None:
        return (
            "lossy: reused only by a request that extends the whole prefix (its layers do not trim)"
        )
    return (
        f"lossy: reused only by a request taking at least {short.tokens} of its "
        f"{manifest.tokens.count} tokens; there max |logit diff| {short.max_abs_logit_diff:.3g}, "
        f"greedy match {short.greedy_match}"
    )


def parent_line(p: dict) -> str:
    """Which kind of child a bundle is, from which parent, at which token."""
    where = f"{p['prefix']}@{p['version']}/{p['folder']} (cache sha256 {p['file_sha256'][:16]}..)"
    n = p["reused_tokens"]
    held = {
        "continued": f"its first {n:,} positions are that bundle's stored {p.get('stored_dtype')} "
        "K/V, unchanged, the new tokens prefilled on top",
        "continued-quantized": f"its first {n:,} positions are that bundle's stored "
        f"{p.get('stored_dtype')} K/V, quantized with the rest",
        None: f"its first {n:,} tokens reused at a prefill chunk boundary (format 2: the bytes "
        "of a build from token 0)",
    }[p.get("kind")]
    how = "continued" if p.get("kind") else "started"
    return (
        f"{how} from {where} at token {n:,}: {held}; as trustworthy as that parent; "
        "'build --full' builds from token 0 and owes no other bundle anything"
    )
