"""The `--json` documents of `push` and `pull` (fleet distribution: a hub repo or an OCI registry).

Version 2 (OCI registries): `commit` and `revision` are null for a registry, each bundle names its
artifact `tag` and `digest`, and `transfer` counts the bytes that moved and those already there.
pull/3: a bundle already here as the artifact has it is `up-to-date` (left as it is, no blob
moved), and each bundle of an OCI pull has its own `transfer`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.cli.reports.base import Refusal, Report

REPO_PATH = "<name>/<version>/<slug>-<fingerprint[:12]> (the hub repo's folder, or the bundle an OCI tag names)"


class Transfer(Report):
    """What moved over the network, and what the other side already had (OCI only)."""

    moved_bytes: int = Field(
        description="bytes uploaded (push) or downloaded (pull), the artifact manifests included"
    )
    moved_blobs: int = Field(description="blobs uploaded or downloaded (manifests not counted)")
    reused_bytes: int = Field(
        description="push: bytes of blobs the registry already had (or mounted from "
        "--mount-from); pull: bytes of blocks taken from bundles already in the bundles folder"
    )
    reused_blobs: int


# --- push ------------------------------------------------------------------------------------


class PushedBundle(Report):
    path: str = Field(description="the local bundle folder, as given")
    status: Literal["pushed", "skipped", "refused"] = Field(
        description="skipped: valid, but not pushed because another bundle was refused"
    )
    prefix: str | None = Field(description="name of the prefix (null when refused)")
    version: int | None = Field(description="prefix version (null when refused)")
    repo_path: str | None = Field(description=f"{REPO_PATH} (null when refused)")
    tokens: int | None = Field(description="tokens in the bundle (null when refused)")
    files: list[str] = Field(description="the files that go to repo_path ([] when refused)")
    reason: str | None = Field(None, description="why it was not pushed (skipped only)")
    refusal: Refusal | None = Field(None, description="why it was refused (refused only)")
    tag: str | None = Field(None, description="OCI: the artifact's tag <name>.V<version>.<folder>")
    digest: str | None = Field(None, description="OCI: the artifact manifest's digest (pin it)")
    bytes: int | None = Field(None, description="OCI: the artifact's size, every blob counted")
    transfer: Transfer | None = Field(None, description="OCI: what this bundle moved")


class PushTotals(Report):
    pushed: int
    skipped: int
    refused: int


class PushReport(Report):
    """`push --json`: the bundles in argument order and the one commit they went into.

    Any refused bundle: nothing is pushed (commit null, the others skipped) and the exit is 1.
    """

    schema_: Literal["push/2"] = Field("push/2", alias="schema")
    repo: str
    revision: str | None = Field(description="the branch committed to (default main); null: OCI")
    commit: str | None = Field(
        description="the commit made; null when nothing was pushed, and for an OCI registry"
    )
    url: str | None = Field(description="the commit on the hub, when the hub gives one")
    bundles: list[PushedBundle]
    deleted: list[str] = Field(
        description="stale files removed from the pushed folders in the same commit"
    )
    totals: PushTotals
    transfer: Transfer | None = Field(None, description="OCI: the push's bytes moved and reused")


# --- pull ------------------------------------------------------------------------------------


class PulledBundle(Report):
    repo_path: str = Field(description=REPO_PATH)
    prefix: str
    version: int
    status: Literal["pulled", "up-to-date", "skipped", "refused", "failed"] = Field(
        description="up-to-date (OCI): the bundle here holds the artifact's files and passes the "
        "validator, so it was left as it is and no blob moved; skipped: not chosen for this "
        "model, or valid but held back because another bundle was refused or failed (reason "
        "says which); failed: valid, but its build lock was held by another build or pull, or "
        "moving it into place failed (reason says which)"
    )
    path: str | None = Field(
        description="where it was published, or would have been; null when not chosen"
    )
    tokens: int | None = Field(description="tokens in the bundle, once validated")
    reason: str | None = Field(None, description="why it was skipped or failed")
    refusal: Refusal | None = Field(
        None, description="the validator's refusal against the model (refused only)"
    )
    digest: str | None = Field(
        None, description="OCI: the artifact manifest's digest (pulled or up-to-date)"
    )
    transfer: Transfer | None = Field(
        None,
        description="OCI: what this bundle moved (its artifact manifest counted: an up-to-date "
        "bundle's is read to compare) and took from bundles already here",
    )


class PullTotals(Report):
    pulled: int
    up_to_date: int
    skipped: int
    refused: int
    failed: int


class PullReport(Report):
    """`pull --json`: every bundle folder of the repo at the resolved commit, by repo_path.

    Any refused or failed bundle: nothing is published, the exit is 1 and the document is still
    printed. An error before any bundle is downloaded (no bundle for this model, hub
    unreachable) is only the `error:` line.

    Changed in pull/3: a bundle already here as the OCI artifact has it is `up-to-date` (left as
    it is, no blob moved; totals.up_to_date counts them), and each bundle of an OCI pull carries
    its own `transfer` (bytes moved, its artifact manifest included, and reused).
    """

    schema_: Literal["pull/3"] = Field("pull/3", alias="schema")
    repo: str
    revision: str | None = Field(description="as asked (default main); null for an OCI registry")
    commit: str | None = Field(
        description="the commit the revision resolved to; all files come from it (null: OCI, "
        "where each bundle's digest says what was pulled)"
    )
    url: str | None = Field(description="the repo's files at that commit on the hub, when known")
    model: str = Field(description="the --model folder")
    bundles_dir: str = Field(
        description="where bundles are published: <model>/prefix-bundles, or --bundles"
    )
    bundles: list[PulledBundle]
    totals: PullTotals
    transfer: Transfer | None = Field(None, description="OCI: the pull's bytes moved and reused")
