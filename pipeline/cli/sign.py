"""`sign`: add manifest.json.minisig to bundles (each validated first); nothing else is rewritten."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.common import err
from pipeline.cli.keys import KEY_ENV, load_secret_key
from pipeline.format.errors import PipelineError


def add_parser(sub: argparse._SubParsersAction, parents: list) -> None:
    s = sub.add_parser(
        "sign",
        parents=parents,
        help="sign bundles with a minisign secret key (manifest.json.minisig)",
    )
    s.add_argument("bundle", nargs="+", type=Path, help="bundle folders")
    s.add_argument(
        "--key", type=Path, metavar="FILE",
        help=f"the secret key file (default: the key text in ${KEY_ENV})",
    )  # fmt: skip
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Sign each bundle that passes the validator (integrity); exit 1 if any was refused."""
    from pipeline.builder.signing import sign_bundle

    key = load_secret_key(args.key)
    failed = 0
    for bundle in args.bundle:
        try:
            sig = sign_bundle(bundle, key)
        except PipelineError as exc:
            err(f"{exc} (not signed)")
            failed += 1
            continue
        print(f"signed {bundle} (key id {sig.key}, trusted comment {sig.trusted_comment!r})")
    return 1 if failed else 0
