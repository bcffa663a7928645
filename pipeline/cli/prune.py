"""`prune`: delete old versions, bundles without a definition and abandoned staging folders."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.common import add_json_option, emit, err, error_text, plural, say, warn
from pipeline.cli.reports import KeptFolder, PrunedFolder, PruneReport, PruneTotals
from pipeline.format.errors import PipelineError
from pipeline.format.names import parse_version


def add_parser(sub: argparse._SubParsersAction, parents: list) -> None:
    p = sub.add_parser(
        "prune",
        parents=parents,
        help="list (or with --apply delete) old versions, orphaned bundles and staging leftovers",
        description="A dry run unless --apply. Lists, under --bundles: versions older than the "
        "newest N per prefix and model folder, bundles whose definition is gone from "
        "--prefixes, and staging folders of processes that are gone, with their sizes. A "
        "version named in prefixes.lock is never deleted.",
    )
    p.add_argument(
        "--keep",
        type=_at_least_one,
        default=1,
        metavar="N",
        help="versions to keep per prefix and model folder (default: 1)",
    )
    p.add_argument("--apply", action="store_true", help="delete what the dry run lists")
    p.add_argument(
        "--snapshots",
        type=Path,
        metavar="DIR",
        help="instead: every snapshot set in serve's --snapshots DIR (they hold client prompts), "
        "deleted with --apply (no other option applies); refused while a serve process uses DIR",
    )
    add_json_option(p, "prune")
    # --snapshots is a form of its own: any other option (--keep, --json, --bundles) is refused
    p.set_defaults(func=run, form_options={"snapshots": {"apply"}})


def _at_least_one(text: str) -> int:
    if (number := parse_version(text)) is None:
        raise argparse.ArgumentTypeError(f"{text!r}: keep at least 1 version, e.g. --keep 2")
    return number


def run(args: argparse.Namespace) -> int:
    from pipeline.builder.retention import plan

    if args.snapshots is not None:
        return _snapshots(args)
    todo = plan(args.bundles, args.prefixes, args.keep)
    folders = [_folder(c, args) for c in todo.delete]
    kept = [
        KeptFolder(
            path=str(k.path),
            prefix=k.prefix,
            version=k.version,
            model_folder=k.model_folder,
            reason=k.reason,
        )
        for k in todo.kept
    ]
    report = PruneReport(
        bundles=str(args.bundles),
        prefixes=str(args.prefixes),
        keep=args.keep,
        applied=args.apply,
        delete=folders,
        kept=kept,
        totals=_totals(folders),
    )
    emit(args, report, _print)
    return 1 if report.totals.failed else 0


def _snapshots(args: argparse.Namespace) -> int:
    """List (with --apply delete) the snapshot sets in a --snapshots folder no serve is using."""
    from pipeline.format.safe_tree import tree_bytes
    from pipeline.runtime.snapshot_store import SnapshotFolder

    # DIR is never made here, and a dry run changes nothing (no lock file is made)
    folder = SnapshotFolder(args.snapshots, create=False, listing=not args.apply)
    try:  # its lock: refused while a serve process holds it
        for line in folder.strays():
            warn(line)
        sets = [path for _, path in folder.sets()]
        size = sum(tree_bytes(folder.root, s) for s in sets)
        if not args.apply:
            for path in sets:
                say(f"would delete {path}")
            say(f"{plural(len(sets), 'snapshot set')}, {_mib(size)}; pass --apply to delete")
            return 0
        gone = folder.wipe()
        say(f"deleted {plural(len(gone), 'folder')} under {args.snapshots}, {_mib(size)}")
        return 0
    finally:
        folder.close()


def _folder(candidate, args: argparse.Namespace) -> PrunedFolder:
    """One planned deletion, carried out with --apply (a failure is one `error:` line)."""
    from pipeline.builder.retention import delete

    c, status, error = candidate, "would-delete", None
    if args.apply:
        try:
            delete(c, args.bundles)
            status = "deleted"
        except (PipelineError, OSError) as exc:
            status, error = "failed", error_text(exc)
            err(f"cannot delete {c.path}: {error}")
    return PrunedFolder(
        path=str(c.path),
        kind=c.kind,
        reason=c.reason,
        bytes=c.bytes,
        prefix=c.prefix,
        version=c.version,
        model_folder=c.model_folder,
        status=status,
        error=error,
    )


def _totals(folders: list[PrunedFolder]) -> PruneTotals:
    deleted = [f for f in folders if f.status == "deleted"]
    return PruneTotals(
        folders=len(folders),
        bytes=sum(f.bytes for f in folders),
        deleted=len(deleted),
        deleted_bytes=sum(f.bytes for f in deleted),
        failed=sum(f.status == "failed" for f in folders),
    )


def _print(report: PruneReport) -> None:
    labels = {"would-delete": "would delete", "deleted": "deleted", "failed": "FAILED"}
    for f in report.delete:
        say(f"{labels[f.status]:<13} {_mib(f.bytes):>10}  {f.path}  ({f.reason})")
    for k in report.kept:
        say(f"{'kept':<13} {'':>10}  {k.path}  ({k.reason})")
    t = report.totals
    if not report.applied:
        more = "; run with --apply to delete them" if t.folders else ""
        say(f"{plural(t.folders, 'folder')}, {_mib(t.bytes)} to reclaim{more}")
    else:
        say(
            f"{plural(t.deleted, 'folder')} deleted, {_mib(t.deleted_bytes)} reclaimed, "
            f"{t.failed} failed"
        )


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"  # as list, serve and build say sizes
