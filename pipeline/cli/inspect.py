"""`inspect`: what a bundle holds, and the validator's verdict stage by stage."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline.cli.common import add_json_option, emit_json, integrity_identity, read_template
from pipeline.cli.keys import add_trusted_key_option, trusted_keys
from pipeline.cli.reports import (
    CheckResult,
    InspectReport,
    Refusal,
    SignatureReport,
    Validity,
    refusal_of,
)


def add_parser(sub: argparse._SubParsersAction, parents: list) -> None:
    i = sub.add_parser(
        "inspect", parents=parents, help="show what a bundle holds and whether it is valid"
    )
    i.add_argument("bundle", type=Path, help="a bundle folder")
    i.add_argument("--model", type=Path, help="also check validity for this model folder")
    i.add_argument("--chat-template", type=Path, help="the template file the server will use")
    add_json_option(i, "inspect")
    add_trusted_key_option(i)
    i.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.format.bundle_folder import read_manifest

    bundle = Path(args.bundle)
    if args.json:
        return _run_json(bundle, args)
    manifest = read_manifest(bundle, None)  # shown even when invalid; validity is decided below
    identity = _identity(args, manifest)
    keys = trusted_keys(args)
    refusal = _validity(bundle, identity, keys)
    _print_manifest(bundle, manifest.model_dump(mode="json"))
    print("  files: " + ", ".join(f"{k} {v:,} B" for k, v in _sizes(bundle).items()))
    print(f"  signature: {_signature_line(bundle)}")
    _print_checks(manifest, args, identity, refusal, keys)
    return 0 if refusal is None else 1


def _run_json(bundle: Path, args: argparse.Namespace) -> int:
    """inspect/1: the manifest's fields (null when unreadable) and every reason it is refused."""
    from pipeline.format.bundle_folder import read_manifest
    from pipeline.format.errors import BundleError
    from pipeline.format.manifest import Manifest

    try:
        manifest = read_manifest(bundle, None)
    except BundleError:
        manifest = None  # the validator below says why, at the stage that refuses it
    identity = _identity(args, manifest) if args.model else integrity_identity(bundle)
    keys = trusted_keys(args)
    refusal = _validity(bundle, identity, keys)
    fields = {name: getattr(manifest, name, None) for name in Manifest.model_fields}
    validity = Validity(
        valid=refusal is None,
        for_model=str(args.model) if args.model else None,
        refusal=refusal_of(refusal) if refusal else None,
        refusals=_refusals(bundle, manifest, identity, refusal),
        checks=_check_results(refusal, bool(keys), args.model is not None),
    )
    sizes = _sizes(bundle) if bundle.is_dir() else {}
    signature = _signature_report(bundle, bool(keys) and refusal is None)
    emit_json(
        InspectReport(
            bundle=str(bundle), files=sizes, validity=validity, signature=signature, **fields
        )
    )
    return 0 if refusal is None else 1


def _refusals(bundle: Path, manifest, identity, refusal) -> list[Refusal]:
    """Every reason: each mismatching fingerprint when identity refused, else the one refusal."""
    from pipeline.format.identity import identity_checks

    if refusal is None:
        return []
    if refusal.check != "identity" or manifest is None:
        return [refusal_of(refusal)]
    failed = [c.error(bundle) for c in identity_checks(manifest, identity) if not c.ok]
    for exc in failed:
        exc.check = "identity"
    return [refusal_of(exc) for exc in failed] or [refusal_of(refusal)]


NO_MODEL = (
    "without --model: the fingerprints the manifest records were not compared with a model "
    "folder; pass --model DIR to check them"
)


def _check_results(refusal, signed: bool, with_model: bool) -> list[CheckResult]:
    """The validator's stages in order: ok up to the one that refused, then not reached; a check
    that was not made (no key, no model) is shown as skipped, never as ok."""
    from pipeline.format.validate import CHECKS

    failed = refusal.check if refusal is not None else None
    results, reached = [], True
    for name, detail in CHECKS:
        if name == "signature" and not signed and reached:
            results.append(CheckResult(name=name, status="skipped", detail=NO_KEY))
        elif name == "identity" and not with_model and reached and failed != name:
            results.append(CheckResult(name=name, status="skipped", detail=NO_MODEL))
        elif name == failed:
            results.append(CheckResult(name=name, status="failed", detail=refusal.reason))
            reached = False
        else:
            status = "ok" if reached else "not-reached"
            results.append(CheckResult(name=name, status=status, detail=detail))
    return results


def _sizes(bundle: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(bundle.iterdir()) if p.is_file()}


def _identity(args: argparse.Namespace, manifest):
    """The served model's identity with --model, else the one the manifest records."""
    from pipeline.format.validate import recorded_identity
    from pipeline.runtime.mount import identity_for

    if args.model:
        return identity_for(args.model, read_template(args.chat_template))
    return recorded_identity(manifest)


NO_KEY = "not checked: no --trusted-key given"


def _signature_line(bundle: Path) -> str:
    """Who signed the bundle and the trusted comment, as written (the checks below verify it)."""
    from pipeline.format.bundle_signature import describe

    info = describe(bundle)
    if info is None:
        return "none (unsigned)"
    if info.problem is not None:
        return f"unreadable: {info.problem}"
    return f"key id {info.key_id}, trusted comment {info.trusted_comment!r}"


def _signature_report(bundle: Path, verified: bool) -> SignatureReport | None:
    from pipeline.format.bundle_signature import describe

    info = describe(bundle) if bundle.is_dir() else None
    if info is None:
        return None
    return SignatureReport(
        key_id=info.key_id,
        trusted_comment=info.trusted_comment,
        problem=info.problem,
        verified=verified and info.problem is None,
    )


def _validity(bundle: Path, identity, keys: tuple = ()):
    """The validator's verdict: None when valid, else the BundleError."""
    from pipeline.format.errors import BundleError
    from pipeline.format.validate import validate

    try:
        validate(bundle, identity, trusted_keys=keys)
    except BundleError as exc:
        return exc
    return None


def _print_checks(manifest, args: argparse.Namespace, identity, refusal, keys: tuple = ()) -> None:
    """The validator's stages in order: ok up to the one that refused, which says why."""
    from pipeline.format.identity import identity_checks
    from pipeline.format.validate import CHECKS

    target = (
        f" for model {args.model}"
        if args.model
        else " (integrity only; pass --model DIR to check fingerprints)"
    )
    print(f"checks{target}:")
    failed = refusal.check if refusal is not None else None
    reached = True
    for name, detail in CHECKS:
        if name == "identity" and args.model and reached:
            for c in identity_checks(manifest, identity):
                line = f"{(c.found or 'none')[:16]}.. matches" if c.ok else c.error(Path("")).reason
                print(f"  {'ok  ' if c.ok else 'FAIL'} {c.what:<21} {line}")
        elif name == "signature" and not keys and reached:
            print(f"  --   {name:<21} {NO_KEY}")
        elif name == failed:
            print(f"  FAIL {name:<21} {refusal.reason}")
        elif reached:
            print(f"  ok   {name:<21} {detail}")
        else:
            print(f"  --   {name:<21} not reached")
        reached = reached and name != failed
    t, f = manifest.tokens, manifest.fidelity
    print(
        f"  info stability              {t.stable_tokens}/{t.rendered_tokens} rendered tokens are a prefix of every probe turn"
    )
    if f.checked:
        print(
            f"  info fidelity               max |logit diff| {f.max_abs_logit_diff:.3g} <= {f.threshold:g}, greedy match {f.greedy_match} (at build, vs {f.reference})"
        )
        print(f"  info serving path           {_serving(f)}")
        print(f"  info reuse rule             {_reuse_rule(manifest)}")
    print(
        f"valid{' for ' + str(args.model) if args.model else ''}: {'yes' if refusal is None else 'no'}"
    )


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
    return f.serving_skipped


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


def _print_manifest(bundle: Path, data: dict) -> None:
    print(f"bundle {bundle}")
    for section in ("prefix", "snapshot", "tokens", "model", "cache", "fidelity", "builder"):
        values = data.get(section)  # a snapshot (serve --snapshots) has no prefix, a bundle none
        if values is not None:
            print(f"  {section}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    if data.get("text") is None:
        return
    print(f"  text: {data['text']['chars']} chars, sha256 {data['text']['sha256'][:16]}..")
    print("  preview: " + json.dumps(data["text"]["preview"], ensure_ascii=False))
    print(f"  build_key: {data['build_key']}")
    if data.get("parent"):  # an incremental build: which bundle's cache it started from
        print(f"  parent: {parent_line(data['parent'])}")
        if data["parent"].get("checked"):
            print(f"  parent checked: {data['parent']['checked']}")


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
