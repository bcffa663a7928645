"""`inspect`: what a bundle holds, and the validator's verdict stage by stage."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline.cli.common import read_template


def add_parser(sub: argparse._SubParsersAction, parents: list) -> None:
    i = sub.add_parser(
        "inspect", parents=parents, help="show what a bundle holds and whether it is valid"
    )
    i.add_argument("bundle", type=Path, help="a bundle folder")
    i.add_argument("--model", type=Path, help="also check validity for this model folder")
    i.add_argument("--chat-template", type=Path, help="the template file the server will use")
    i.add_argument("--json", action="store_true", help="print the manifest and validity as JSON")
    i.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.format.bundle_files import read_manifest

    bundle = Path(args.bundle)
    manifest = read_manifest(bundle, None)  # shown even when invalid; validity is decided below
    refusal = _validity(bundle, manifest, args)
    if args.json:
        data = manifest.model_dump(mode="json")
        data["validity"] = {
            "valid": refusal is None,
            "for_model": str(args.model) if args.model else None,
            "refusal": None
            if refusal is None
            else {"field": refusal.field, "reason": refusal.reason},
        }
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0 if refusal is None else 1
    _print_manifest(bundle, manifest.model_dump(mode="json"))
    sizes = {p.name: p.stat().st_size for p in sorted(bundle.iterdir()) if p.is_file()}
    print("  files: " + ", ".join(f"{k} {v:,} B" for k, v in sizes.items()))
    _print_checks(manifest, args, refusal)
    return 0 if refusal is None else 1


def _validity(bundle: Path, manifest, args: argparse.Namespace):
    """The validator's verdict: None when valid, else the BundleError (for the model, if given)."""
    from pipeline.format.errors import BundleError
    from pipeline.runtime.mount import identity_for
    from pipeline.runtime.validate import recorded_identity, validate

    identity = (
        identity_for(args.model, read_template(args.chat_template))
        if args.model
        else recorded_identity(manifest)
    )
    try:
        validate(bundle, identity)
    except BundleError as exc:
        return exc
    return None


def _print_checks(manifest, args: argparse.Namespace, refusal) -> None:
    """The validator's stages in order: ok up to the one that refused, which says why."""
    from pipeline.runtime.identity import identity_checks
    from pipeline.runtime.mount import identity_for
    from pipeline.runtime.validate import CHECKS

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
            identity = identity_for(args.model, read_template(args.chat_template))
            for c in identity_checks(manifest, identity):
                line = f"{(c.found or 'none')[:16]}.. matches" if c.ok else c.error(Path("")).reason
                print(f"  {'ok  ' if c.ok else 'FAIL'} {c.what:<21} {line}")
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
            f"  info fidelity               max |logit diff| {f.max_abs_logit_diff:.3g} <= {f.threshold:g}, greedy match {f.greedy_match} (at build)"
        )
    print(
        f"valid{' for ' + str(args.model) if args.model else ''}: {'yes' if refusal is None else 'no'}"
    )


def _print_manifest(bundle: Path, data: dict) -> None:
    print(f"bundle {bundle}")
    for section in ("prefix", "tokens", "model", "cache", "fidelity", "builder"):
        values = data[section]
        print(f"  {section}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    print(f"  text: {data['text']['chars']} chars, sha256 {data['text']['sha256'][:16]}..")
    print("  preview: " + json.dumps(data["text"]["preview"], ensure_ascii=False))
    print(f"  build_key: {data['build_key']}")
