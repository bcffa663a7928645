"""`inspect`: what a bundle holds, and the validator's verdict stage by stage."""

from __future__ import annotations

import argparse
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
    from pipeline.cli.inspect_text import print_inspect

    manifest = read_manifest(bundle, None, kind=None)  # shown even when invalid (either kind)
    identity = _identity(args, manifest)
    keys = trusted_keys(args)
    kind = expected_kind(bundle)
    refusal = _validity(bundle, identity, keys, kind)
    print_inspect(bundle, manifest, args, identity, refusal, keys, kind)
    return 0 if refusal is None else 1


def _run_json(bundle: Path, args: argparse.Namespace) -> int:
    """inspect/1: the manifest's fields (null when unreadable) and every reason it is refused."""
    from pipeline.format.bundle_folder import read_manifest
    from pipeline.format.errors import BundleError
    from pipeline.format.manifest import Manifest

    try:
        manifest = read_manifest(bundle, None, kind=None)  # a snapshot too
    except BundleError:
        manifest = None  # the validator below says why, at the stage that refuses it
    identity = _identity(args, manifest) if args.model else integrity_identity(bundle)
    keys = trusted_keys(args)
    kind = expected_kind(bundle)
    refusal = _validity(bundle, identity, keys, kind)
    fields = {name: getattr(manifest, name, None) for name in Manifest.model_fields}
    validity = Validity(
        valid=refusal is None,
        for_model=str(args.model) if args.model else None,
        refusal=refusal_of(refusal) if refusal else None,
        refusals=_refusals(bundle, manifest, identity, refusal),
        checks=_check_results(refusal, bool(keys), args.model is not None, kind),
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


def _check_results(
    refusal, signed: bool, with_model: bool, kind: str = "prefix"
) -> list[CheckResult]:
    """The validator's stages in order: ok up to the one that refused, then not reached; a check
    that was not made (no key, no model) is shown as skipped, never as ok."""
    from pipeline.format.validate import CHECKS

    failed = refusal.check if refusal is not None else None
    results, reached = [], True
    for name, detail in CHECKS:
        if name == "signature" and not signed and reached:
            why = NO_HOST_KEY if kind == "snapshot" else NO_KEY
            results.append(CheckResult(name=name, status="skipped", detail=why))
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
NO_HOST_KEY = (
    "not checked: a snapshot is signed with its host's snapshot key, which inspect does not read "
    "(serve mounts it only where that key verifies it: docs/signing.md)"
)


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


def expected_kind(bundle: Path) -> str:
    """The kind serve takes the folder for, whatever its manifest says: "snapshot" only inside a
    set serve wrote (DIR/set-N/<rank>-<id>, the set holding serve's mark), else "prefix" (as
    verify and mount judge a bundle folder), so inspect gives the same folder the same verdict."""
    from pipeline.runtime.snapshot_store import SET_NAME, is_marked

    set_folder = Path(bundle).absolute().parent
    return "snapshot" if SET_NAME.match(set_folder.name) and is_marked(set_folder) else "prefix"


def _validity(bundle: Path, identity, keys: tuple = (), kind: str = "prefix"):
    """The validator's verdict for a bundle or a snapshot (`kind`, by where the folder is): None
    when valid, else the BundleError."""
    from pipeline.format.errors import BundleError
    from pipeline.format.validate import validate

    try:
        validate(bundle, identity, trusted_keys=keys, kind=kind)
    except BundleError as exc:
        return exc
    return None
