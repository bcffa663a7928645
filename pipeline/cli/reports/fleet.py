"""The `--json` documents of `push` and `pull` (fleet distribution through a hub repo)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.cli.reports.base import Refusal, Report

REPO_PATH = "<name>/<version>/<slug>-<fingerprint[:12]> in the hub repo"

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


class PushTotals(Report):
    pushed: int
    skipped: int
    refused: int


class PushReport(Report):
    """`push --json`: the bundles in argument order and the one commit they went into.

    Any refused bundle: nothing is pushed (commit null, the others skipped) and the exit is 1.
    """

    schema_: Literal["push/1"] = Field("push/1", alias="schema")
    repo: str
    revision: str = Field(description="the branch committed to (default main)")
    commit: str | None = Field(description="the commit made; null when nothing was pushed")
    url: str | None = Field(description="the commit on the hub, when the hub gives one")
    bundles: list[PushedBundle]
    deleted: list[str] = Field(
        description="stale files removed from the pushed folders in the same commit"
    )
    totals: PushTotals


# --- pull ------------------------------------------------------------------------------------


class PulledBundle(Report):
    repo_path: str = Field(description=REPO_PATH)
    prefix: str
    version: int
    status: Literal["pulled", "skipped", "refused", "failed"] = Field(
        description="skipped: not chosen for this model, or valid but held back because another "
        "bundle was refused or failed (reason says which); failed: valid, but its build lock was "
        "held by another build or pull, or moving it into place failed (reason says which)"
    )
    path: str | None = Field(
        description="where it was published, or would have been; null when not chosen"
    )
    tokens: int | None = Field(description="tokens in the bundle, once validated")
    reason: str | None = Field(None, description="why it was skipped or failed")
    refusal: Refusal | None = Field(
        None, description="the validator's refusal against the model (refused only)"
    )


class PullTotals(Report):
    pulled: int
    skipped: int
    refused: int
    failed: int


class PullReport(Report):
    """`pull --json`: every bundle folder of the repo at the resolved commit, by repo_path.

    Any refused or failed bundle: nothing is published, the exit is 1 and the document is still
    printed. An error before any bundle is downloaded (no bundle for this model, hub
    unreachable) is only the `error:` line.
    """

    schema_: Literal["pull/1"] = Field("pull/1", alias="schema")
    repo: str
    revision: str = Field(description="as asked (default main)")
    commit: str = Field(description="the commit the revision resolved to; all files come from it")
    url: str | None = Field(description="the repo's files at that commit on the hub, when known")
    model: str = Field(description="the --model folder")
    bundles_dir: str = Field(
        description="where bundles are published: <model>/prefix-bundles, or --bundles"
    )
    bundles: list[PulledBundle]
    totals: PullTotals
