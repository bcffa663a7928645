"""`pull`: the bundles of a hub repo that fit a local model, validated and published next to it."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.common import emit_json, err


def add_parser(sub: argparse._SubParsersAction, parents: list) -> None:
    p = sub.add_parser(
        "pull",
        parents=parents,
        help="download the bundles for a model from a hub repo, validate, publish atomically",
    )
    p.add_argument("--repo", required=True, help="hub model repo ORG/NAME")
    p.add_argument("--revision", help="branch, tag or commit (default: main)")
    p.add_argument(
        "--model",
        type=Path,
        required=True,
        help="the model folder the bundles are for; they go to <model>/prefix-bundles unless "
        "--bundles is given",
    )
    p.add_argument(
        "--prefix",
        action="append",
        metavar="NAME[@VERSION]",
        help="only this prefix (repeatable; default: every prefix, highest version)",
    )
    p.add_argument("--json", action="store_true", help="print what was pulled as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.cli import DEFAULT_BUNDLES
    from pipeline.distribute.pull import pull

    # --bundles not given: pull() puts them next to the model, in <model>/prefix-bundles
    bundles = None if args.bundles is DEFAULT_BUNDLES else args.bundles
    result = pull(args.repo, args.model, bundles, args.revision, args.prefix)
    for refusal in result.refused:
        err(f"{refusal} (nothing was published)")
    if args.json:
        emit_json(
            {
                "repo": result.repo,
                "revision": result.revision,
                "commit": result.commit,
                "model": str(result.model),
                "bundles_dir": str(result.bundles_dir),
                "pulled": [
                    {
                        "prefix": b.name,
                        "version": b.version,
                        "repo_path": b.repo_path,
                        "path": str(b.path),
                        "tokens": b.tokens,
                    }
                    for b in result.pulled
                ],
                "skipped": [{"repo_path": s.repo_path, "reason": s.reason} for s in result.skipped],
                "refused": [
                    {"field": r.field, "reason": r.reason, "bundle": r.bundle}
                    for r in result.refused
                ],
            }
        )
    else:
        at = f"{result.repo}@{result.commit[:12]}"
        for b in result.pulled:
            print(f"pulled {b.name}@{b.version} ({b.tokens} tokens) from {at} -> {b.path}")
        for s in result.skipped:
            print(f"skipped {s.repo_path}: {s.reason}")
    return 1 if result.refused else 0
