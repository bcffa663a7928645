"""`push`: validate bundles and upload them to a hub repo, one commit per push."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.common import emit_json, err
from pipeline.format.errors import PipelineError


def add_parser(sub: argparse._SubParsersAction, parents: list) -> None:
    p = sub.add_parser(
        "push",
        parents=parents,
        help="validate bundles and upload them to a hub model repo (one commit)",
    )
    p.add_argument("bundle", nargs="+", type=Path, help="bundle folders")
    p.add_argument("--repo", required=True, help="hub model repo ORG/NAME (create it, private)")
    p.add_argument("--revision", help="branch to commit to (default: main; created if missing)")
    p.add_argument("--json", action="store_true", help="print what was pushed as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.distribute.push import check_bundle, push

    checked, refused = [], 0
    for bundle in args.bundle:
        try:
            checked.append(check_bundle(bundle))
        except PipelineError as exc:
            err(f"{exc} (nothing was pushed to {args.repo})")
            refused += 1
    if refused:
        return 1
    result = push(checked, args.repo, args.revision)
    if args.json:
        emit_json(
            {
                "repo": result.repo,
                "revision": result.revision,
                "commit": result.commit,
                "url": result.url,
                "bundles": [
                    {
                        "path": str(b.local),
                        "repo_path": b.repo_path,
                        "prefix": b.name,
                        "version": b.version,
                        "files": list(b.files),
                    }
                    for b in result.bundles
                ],
                "deleted": result.deleted,
            }
        )
        return 0
    for b in result.bundles:
        print(f"pushed {b.label} -> {result.repo}@{result.revision}:{b.repo_path}")
    for path in result.deleted:
        print(f"removed stale {result.repo}@{result.revision}:{path}")
    print(f"commit {result.commit or '?'} {result.url or ''}".rstrip())
    return 0
