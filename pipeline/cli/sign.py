"""`sign`: add manifest.json.minisig to bundles (each validated first); nothing else is rewritten."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.common import add_json_option, emit_json, err, say
from pipeline.cli.keys import KEY_ENV, load_secret_key
from pipeline.format.errors import PipelineError


def add_parser(sub: argparse._SubParsersAction, parents: list) -> None:
    s = sub.add_parser(
        "sign",
        parents=parents,
        help="sign bundles with a minisign secret key (manifest.json.minisig)",
    )
    s.add_argument(
        "bundle", nargs="+", type=Path, action="distinct", help="bundle folders, each once"
    )
    s.add_argument(
        "--key", type=Path, metavar="FILE",
        help=f"the secret key file (default: the key text in ${KEY_ENV})",
    )  # fmt: skip
    s.add_argument(
        "--replace", action="store_true",
        help="replace a signature by another key (or an unreadable one); a signature by this "
        "key that no longer verifies is never replaced: rebuild that bundle",
    )  # fmt: skip
    add_json_option(s, "sign")
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Sign each bundle that passes the validator (integrity); exit 1 if any was refused."""
    from pipeline.builder.signing import sign_bundle

    key = load_secret_key(args.key)
    rows = []
    for bundle in args.bundle:
        try:
            signed = sign_bundle(bundle, key, replace=args.replace)
        except PipelineError as exc:
            err(f"{exc} (not signed)")
            rows.append(_row(bundle, None, str(exc)))
            continue
        rows.append(_row(bundle, signed, None))
        if not args.json:
            _print_signed(bundle, signed)
    if args.json:
        _emit(key.public_key().id, rows)
    return 1 if any(r.status == "refused" for r in rows) else 0


def _row(bundle: Path, signed, error: str | None):
    from pipeline.cli.reports import SignedBundle

    if signed is None:
        return SignedBundle(
            path=str(bundle), status="refused", trusted_comment=None, replaced=None,
            vouches_for=None, error=error,
        )  # fmt: skip
    return SignedBundle(
        path=str(bundle),
        status="already-signed" if signed.already else "signed",
        trusted_comment=signed.signature.trusted_comment,
        replaced=None if signed.already else signed.replaced,
        vouches_for=signed.covers(),
        error=None,
    )


def _emit(key_id: str, rows: list) -> None:
    from pipeline.cli.reports import SignReport, SignTotals

    states = [r.status for r in rows]
    totals = SignTotals(
        signed=states.count("signed"),
        already_signed=states.count("already-signed"),
        refused=states.count("refused"),
    )
    emit_json(SignReport(key_id=key_id, bundles=rows, totals=totals))


def _print_signed(bundle: Path, signed) -> None:
    sig = signed.signature
    verb = "already signed" if signed.already else "signed"
    was = (
        f", replacing key id {signed.replaced}'s signature"
        if signed.replaced and not signed.already
        else ""
    )
    say(f"{verb} {bundle} (key id {sig.key}, trusted comment {sig.trusted_comment!r}{was})")
    say(f"  vouches for: {signed.covers()}")
    say(
        "  checked: every byte against the manifest (integrity); not checked: that the cache "
        "is what the model computes (build --sign-key proves that by building)"
    )
