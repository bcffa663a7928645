"""`push`: validate bundles and upload them to a hub repo (one commit) or an OCI registry (one
artifact and tag per bundle, only the blobs it lacks)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.cli.common import add_json_option, emit_json, err, say
from pipeline.cli.reports import PushedBundle, PushReport, PushTotals, refusal_of
from pipeline.cli.reports.fleet import Transfer
from pipeline.format.errors import PipelineError

if TYPE_CHECKING:
    from pipeline.distribute.checked import CheckedBundle
    from pipeline.distribute.prehash import Prehash


def add_parser(sub: argparse._SubParsersAction, parents: list) -> None:
    p = sub.add_parser(
        "push",
        parents=parents,
        help="validate bundles and upload them to a hub model repo (one commit) or an OCI "
        "registry (oci://HOST/NAMESPACE/NAME: only new blocks move)",
    )
    p.add_argument(
        "bundle", nargs="+", type=Path, action="distinct", help="bundle folders, each once"
    )
    p.add_argument(
        "--repo",
        required=True,
        help="hub model repo ORG/NAME (create it, private), or oci://HOST[:PORT]/NAMESPACE/NAME",
    )
    p.add_argument(
        "--revision", help="hub: branch to commit to (default: main; created if missing)"
    )
    add_registry_options(p)
    p.add_argument(
        "--mount-from",
        action="append",
        default=[],
        metavar="oci://HOST/REPO",
        help="OCI: another repository of the same registry to mount blobs from (repeatable)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="OCI: ask the registry which blobs it has and say what would move, in bytes; "
        "upload, mount and tag nothing",
    )
    p.add_argument(
        "--lockfile",
        type=Path,
        metavar="FILE",
        help="OCI: record each pushed artifact's digest in this prefixes.lock (the entry of its "
        "version), so that 'pull --lockfile' pins deploys by digest",
    )
    add_json_option(p, "push", version=2)
    p.set_defaults(func=run)


def add_registry_options(p: argparse.ArgumentParser) -> None:
    """--plain-http and --ca-bundle, for an oci:// --repo (push and pull)."""
    p.add_argument(
        "--plain-http",
        action="store_true",
        help="OCI: talk plain HTTP to the registry (default HTTPS; on loopback HTTPS is tried "
        "first and plain HTTP used where the port speaks it)",
    )
    p.add_argument(
        "--ca-bundle", type=Path, metavar="FILE", help="OCI: a PEM file of CAs to verify TLS with"
    )


def hub_refuses_registry_options(args: argparse.Namespace) -> None:
    """--plain-http and --ca-bundle name how to reach a registry: for a hub repo, one line."""
    given = [
        o for o, v in (("--plain-http", args.plain_http), ("--ca-bundle", args.ca_bundle)) if v
    ]
    if given:
        raise PipelineError(
            f"{given[0]} is for an oci:// registry; {args.repo} is a hub repo (the hub client "
            "reads HF_ENDPOINT and the system's CAs): drop it"
        )


def run(args: argparse.Namespace) -> int:
    oci = args.repo.startswith("oci://")
    if not oci:
        hub_refuses_registry_options(args)
        return _run(args, None)
    from pipeline.distribute.prehash import Prehash

    prehash = Prehash([Path(b) for b in args.bundle])  # block digests while they are validated
    try:
        return _run(args, prehash)
    finally:
        prehash.close()


def _run(args: argparse.Namespace, prehash: Prehash | None) -> int:
    from pipeline.distribute.checked import check_bundle
    from pipeline.distribute.push import HELD_BACK, push

    checked: list[CheckedBundle | PushedBundle] = []  # in argument order; PushedBundle: refused
    oci = prehash is not None
    for bundle in args.bundle:
        try:  # OCI: every block is hashed as it goes up, and the puller checks every byte
            checked.append(check_bundle(bundle, trust_memo=oci))
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
            revision = None if oci else args.revision or "main"
            emit_json(_report(args.repo, revision, None, None, entries, []))
        return 1
    if oci:
        return _run_oci(args, checked, prehash)
    if args.lockfile:
        raise PipelineError(
            f"--lockfile records OCI artifact digests; {args.repo} is a hub repo (pin it by "
            "its commit): leave --lockfile out"
        )
    if args.dry_run:
        raise PipelineError(
            f"--dry-run is for an oci:// registry; {args.repo} is a hub repo (one commit of "
            "the listed files): leave --dry-run out"
        )
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
        say(f"pushed {b.label} -> {result.repo}@{result.revision}:{b.repo_path}")
    for path in result.deleted:
        say(f"removed stale {result.repo}@{result.revision}:{path}")
    say(f"commit {result.commit or '?'} {result.url or ''}".rstrip())
    return 0


def _run_oci(
    args: argparse.Namespace, checked: list[CheckedBundle], prehash: Prehash | None = None
) -> int:
    from pipeline.distribute.oci_push import push_oci

    if args.revision:
        raise PipelineError(
            f"--revision is for a hub repo; {args.repo} is an OCI registry (each bundle has its "
            "own tag): drop --revision"
        )
    from pipeline.distribute.meter import Meter

    if args.lockfile:  # before anything moves: it must lock every version pushed
        from pipeline.format.lockfile import given_lock, locked_entry

        lock = given_lock(args.lockfile)
        for b in checked:
            locked_entry(args.lockfile, lock, b.name, b.version)

    ca = str(args.ca_bundle) if args.ca_bundle else None
    meter = Meter(None if args.json or args.dry_run else transfer_progress("push"))
    result = push_oci(
        checked, args.repo, mount_from=args.mount_from, plain_http=args.plain_http, ca_bundle=ca,
        dry_run=args.dry_run, meter=meter, prehash=prehash,
    )  # fmt: skip
    if args.lockfile and not args.dry_run:
        _record_digests(args.lockfile, result.artifacts)
    verb = "would push" if args.dry_run else "pushed"
    if args.json:
        entries = [
            (
                _entry(a.bundle, "skipped", DRY_RUN) if args.dry_run else _entry(a.bundle, "pushed")
            ).model_copy(
                update={
                    "tag": a.tag,
                    "digest": a.digest,
                    "bytes": a.total_bytes,
                    "transfer": transfer_of(a.transfer),
                }
            )
            for a in result.artifacts
        ]
        report = _report(result.repo, None, None, None, entries, [])
        emit_json(report.model_copy(update={"transfer": transfer_of(result.transfer)}))
        return 0
    for a in result.artifacts:
        t = a.transfer
        say(
            f"{verb} {a.bundle.label} -> {result.repo}:{a.tag}@{a.digest} "
            f"({t.moved_bytes:,} bytes {'to upload' if args.dry_run else 'uploaded'}, "
            f"{t.reused_bytes:,} already there)"
        )
    t = result.transfer
    moved = "would be uploaded" if args.dry_run else "uploaded"
    say(f"{t.moved_bytes:,} bytes {moved} in {t.moved_blobs} blobs, {t.reused_bytes:,} bytes in "
          f"{t.reused_blobs} blobs already in the registry")  # fmt: skip
    return 0


def _record_digests(lockfile: Path, artifacts: list) -> None:
    from pipeline.format.lockfile import record_artifacts

    for a in artifacts:
        name, version, folder = a.bundle.repo_path.split("/")
        record_artifacts(lockfile, name, int(version), {folder: a.digest})


PLAIN_MIN_BYTES = 64 << 20  # plain progress lines only for artifacts this large
PLAIN_EVERY_S = 2.0


def transfer_progress(verb: str):
    """Progress of each artifact on stderr: a rich bar (bytes, rate, ETA) on a terminal, else
    plain lines for artifacts of 64 MiB or more, at most one every 2 s and the last."""
    return _transfer_bar(verb) if sys.stderr.isatty() else _transfer_lines(verb)


def transfer_text(done: int, total: int, reused: int, elapsed: float) -> str:
    """'120.0/940.0 MiB (20.0 MiB already here), 110.0 MiB/s, ETA 7.5s': the rate counts the
    bytes that moved, not those already there."""
    mib = 1 << 20
    there = f" ({reused / mib:,.1f} MiB already here)" if reused else ""
    text = f"{done / mib:,.1f}/{total / mib:,.1f} MiB{there}"
    moved = done - reused
    if moved <= 0 or elapsed <= 0:
        return text
    rate = moved / elapsed
    return f"{text}, {rate / mib:,.1f} MiB/s, ETA {(total - done) / rate:.1f}s"


def _transfer_bar(verb: str):
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn

    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[text]}"))
    # no refresh thread: a failed transfer cannot leave a live display behind
    bar = Progress(*columns, console=Console(stderr=True), auto_refresh=False)
    tasks: dict[str, int] = {}

    def report(label: str, done: int, total: int, reused: int, elapsed: float) -> None:
        text = transfer_text(done, total, reused, elapsed)
        if label not in tasks:  # one bar per artifact, one after the other
            tasks[label] = bar.add_task(f"{verb} {label}", total=total, text=text)
            bar.start()
        bar.update(tasks[label], completed=done, text=text, refresh=True)
        if done >= total:
            bar.stop()

    return report


def _transfer_lines(verb: str):
    shown: dict[str, tuple[int, float]] = {}  # label -> (bytes done, when) of its last line

    def report(label: str, done: int, total: int, reused: int, elapsed: float) -> None:
        now = time.perf_counter()
        last = shown.get(label)
        if total < PLAIN_MIN_BYTES or (last and last[0] == done):
            return
        if last and done < total and now - last[1] < PLAIN_EVERY_S:
            return
        shown[label] = (done, now)
        text = transfer_text(done, total, reused, elapsed)
        say(f"{verb} {label}: {text}", file=sys.stderr, flush=True)

    return report


DRY_RUN = "--dry-run: nothing was uploaded or tagged; `transfer` is what would move"


def transfer_of(t) -> Transfer:
    return Transfer(
        moved_bytes=t.moved_bytes,
        moved_blobs=t.moved_blobs,
        reused_bytes=t.reused_bytes,
        reused_blobs=t.reused_blobs,
    )


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
    revision: str | None,
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
