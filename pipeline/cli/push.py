"""`push`: validate bundles and upload them to a hub repo, one commit per push."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.cli.common import add_json_option, emit_json, err
from pipeline.cli.reports import PushedBundle, PushReport, PushTotals, refusal_of
from pipeline.format.errors import PipelineError

if TYPE_CHECKING:
    from pipeline.distribute.push import CheckedBundle


def add_parser(sub: argparse._SubParsersAction, parents: list) -> None:
    p = sub.add_parser(
        "push",
        parents=parents,
        help="validate bundles and upload them to a hub model repo (one commit)",
    )
    p.add_argument("bundle", nargs="+", type=Path, help="bundle folders")
    p.add_argument("--repo", required=True, help="hub model repo ORG/NAME (create it, private)")
    p.add_argument("--revision", help="branch to commit to (default: main; created if missing)")
    add_json_option(p, "push")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.distribute.push import HELD_BACK, check_bundle, push

    checked: list[CheckedBundle | PushedBundle] = []  # in argument order; PushedBundle: refused
    for bundle in args.bundle:
        try:
            checked.append(check_bundle(bundle))
        except PipelineError as exc:
            err(f"{exc} (nothing was pushed to {args.repo})")
            refusal = refusal_of(exc)
            checked.append(
                PushedBundle(
                    path=str(bundle),
                    status="refused",
                    prefix=None,
                    version=None,
                    repo_path=None,
                    tokens=None,
                    files=[],
                    refusal=refusal,
                )
            )
    if any(isinstance(c, PushedBundle) for c in checked):
        if args.json:
            entries = [
                c if isinstance(c, PushedBundle) else _entry(c, "skipped", HELD_BACK)
                for c in checked
            ]
            emit_json(_report(args.repo, args.revision or "main", None, None, entries, []))
        return 1
    result = push(checked, args.repo, args.revision)
    if args.json:
        entries = [_entry(b, "pushed") for b in result.bundles]
        emit_json(
            _report(
                result.repo, result.revision, result.commit, result.url, entries, result.deleted
            )
        )
        return 0
    for b in result.bundles:
        print(f"pushed {b.label} -> {result.repo}@{result.revision}:{b.repo_path}")
    for path in result.deleted:
        print(f"removed stale {result.repo}@{result.revision}:{path}")
    print(f"commit {result.commit or '?'} {result.url or ''}".rstrip())
    return 0


def _entry(b: CheckedBundle, status: str, reason: str | None = None) -> PushedBundle:
    """A bundle that passed the validator, as the document lists it."""
    return PushedBundle(
        path=str(b.local),
        status=status,
        prefix=b.name,
        version=b.version,
        repo_path=b.repo_path,
        tokens=b.tokens,
        files=list(b.files),
        reason=reason,
    )


def _report(
    repo: str,
    revision: str,
    commit: str | None,
    url: str | None,
    entries: list[PushedBundle],
    deleted: list[str],
) -> PushReport:
    count = [e.status for e in entries].count
    totals = PushTotals(pushed=count("pushed"), skipped=count("skipped"), refused=count("refused"))
    return PushReport(
        repo=repo,
        revision=revision,
        commit=commit,
        url=url,
        bundles=entries,
        deleted=list(deleted),
        totals=totals,
    )
