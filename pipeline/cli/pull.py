"""`pull`: the bundles of a hub repo or an OCI registry that fit a local model, validated and
published next to it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.cli.common import add_json_option, emit_json, err, note, say
from pipeline.cli.keys import add_trusted_key_option, trusted_keys
from pipeline.cli.push import (
    add_registry_options,
    hub_refuses_registry_options,
    transfer_of,
    transfer_progress,
)
from pipeline.cli.reports import PulledBundle, PullReport, PullTotals, refusal_of

if TYPE_CHECKING:
    from pipeline.distribute.publish import PullResult

BY_TAG = "by tag: the lockfile records no digest for it (push --lockfile records one)"


def add_parser(sub: argparse._SubParsersAction, parents: list) -> None:
    p = sub.add_parser(
        "pull",
        parents=parents,
        help="download the bundles for a model from a hub repo or an OCI registry, validate, "
        "publish atomically",
    )
    p.add_argument(
        "--repo", required=True, help="hub model repo ORG/NAME, or oci://HOST[:PORT]/NAMESPACE/NAME"
    )
    p.add_argument("--revision", help="hub: branch, tag or commit (default: main)")
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
    p.add_argument(
        "--lockfile",
        type=Path,
        metavar="FILE",
        help="pull exactly the bundle folders this prefixes.lock names for the model (instead "
        "of --prefix); OCI: each by the artifact digest `push --lockfile` recorded, else by tag",
    )
    add_registry_options(p)
    add_json_option(p, "pull", version=3)
    add_trusted_key_option(p)
    p.set_defaults(func=run, bundles_near_model=True)  # default: <model>/prefix-bundles


def run(args: argparse.Namespace) -> int:
    # --bundles not given (None): pull() puts them next to the model, in <model>/prefix-bundles
    locked = _locked(args)
    if args.repo.startswith("oci://"):
        result = _pull_oci(args, locked)
    else:
        from pipeline.distribute.pull import pull

        hub_refuses_registry_options(args)
        keys = trusted_keys(args)
        result = pull(args.repo, args.model, args.bundles, args.revision, args.prefix, keys, locked)
    for line in result.notes:
        note(f"not reused for blocks: {line}")
    for refused in result.refused:
        err(f"{refused.error} (nothing was published)")
    for failed in result.failed:
        err(f"bundle {failed.repo_path}: {failed.reason} (nothing was published)")
    if args.json:
        emit_json(_report(result))
    else:
        _print(result)
    return 1 if result.refused or result.failed else 0


def _locked(args: argparse.Namespace) -> dict[str, str | None] | None:
    """--lockfile: {repo path: artifact digest or None} of exactly the folders it names."""
    if not args.lockfile:
        return None
    from pipeline.distribute.selection import locked_selection
    from pipeline.format.errors import PipelineError

    if args.prefix:
        raise PipelineError(
            "--prefix and --lockfile both choose what to pull: pass one (the lockfile pins "
            "every prefix it locks for the model)"
        )
    return locked_selection(args.lockfile, args.model)


def _pull_oci(args: argparse.Namespace, locked: dict[str, str | None] | None) -> PullResult:
    from pipeline.distribute.oci_pull import pull_oci
    from pipeline.format.errors import PipelineError

    if args.revision:
        raise PipelineError(
            f"--revision is for a hub repo; {args.repo} is an OCI registry: pick bundles with "
            "--prefix NAME@VERSION"
        )
    from pipeline.distribute.meter import Meter

    return pull_oci(
        args.repo,
        args.model,
        args.bundles,
        args.prefix,
        trusted_keys(args),
        plain_http=args.plain_http,
        ca_bundle=str(args.ca_bundle) if args.ca_bundle else None,
        meter=Meter(None if args.json else transfer_progress("pull")),
        locked=locked,
    )


def _print(result: PullResult) -> None:
    at = result.repo if result.commit is None else f"{result.repo}@{result.commit[:12]}"
    for b in result.pulled:
        digest = result.digests.get(b.repo_path)
        where = f"{at}@{digest}" if digest else at
        if b.repo_path in result.by_tag:
            where += f" {BY_TAG}"
        say(f"pulled {b.name}@{b.version} ({b.tokens} tokens) from {where} -> {b.path}")
    for b in result.current:
        say(f"up to date {b.name}@{b.version} ({b.tokens} tokens) at {b.path} "
            f"({result.digests[b.repo_path]})")  # fmt: skip
    for s in result.skipped:
        say(f"skipped {s.repo_path}: {s.reason}")
    t = result.transfer
    if t is not None and not (t.moved_blobs or t.reused_blobs):  # every bundle up to date
        say(f"no blob downloaded ({t.moved_bytes:,} bytes of artifact manifests read)")
    elif t is not None:
        say(f"{t.moved_bytes:,} bytes downloaded in {t.moved_blobs} blobs, {t.reused_bytes:,} "
              f"bytes in {t.reused_blobs} blocks reused from bundles already here")  # fmt: skip


def _report(result: PullResult) -> PullReport:
    """Every bundle folder of the repo, pulled, skipped or refused, in repo_path order."""

    def entry(x, status: str, **fields) -> PulledBundle:
        return PulledBundle(
            repo_path=x.repo_path, prefix=x.name, version=x.version, status=status, **fields
        )

    digests, moved = result.digests, result.transfers

    def fetched(b, status: str) -> PulledBundle:
        t = moved.get(b.repo_path)
        return entry(
            b,
            status,
            path=str(b.path),
            tokens=b.tokens,
            digest=digests.get(b.repo_path),
            reason=BY_TAG if b.repo_path in result.by_tag else None,
            transfer=transfer_of(t) if t is not None else None,
        )

    entries = (
        [fetched(b, "pulled") for b in result.pulled]
        + [fetched(b, "up-to-date") for b in result.current]
        + [
            entry(s, "skipped", path=s.path and str(s.path), tokens=s.tokens, reason=s.reason)
            for s in result.skipped
        ]
        + [
            entry(r, "refused", path=str(r.path), tokens=None, refusal=refusal_of(r.error))
            for r in result.refused
        ]
        + [
            entry(f, "failed", path=str(f.path), tokens=f.tokens, reason=f.reason)
            for f in result.failed
        ]
    )
    return PullReport(
        repo=result.repo,
        revision=result.revision,
        commit=result.commit,
        url=result.url,
        model=str(result.model),
        bundles_dir=str(result.bundles_dir),
        bundles=sorted(entries, key=lambda e: e.repo_path),
        totals=PullTotals(
            pulled=len(result.pulled),
            up_to_date=len(result.current),
            skipped=len(result.skipped),
            refused=len(result.refused),
            failed=len(result.failed),
        ),
        transfer=transfer_of(result.transfer) if result.transfer is not None else None,
    )
