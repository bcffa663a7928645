"""The `--json` documents about local bundles and definitions: verify, inspect, list, build, prune."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.cli.reports.base import Refusal, Report
from pipeline.format.manifest import (
    BuilderInfo,
    CacheInfo,
    FidelityInfo,
    ModelInfo,
    ParentInfo,
    PrefixInfo,
    RequestInfo,
    SnapshotInfo,
    TextInfo,
    TokenInfo,
)

# --- verify ----------------------------------------------------------------------------------


class VerifiedBundle(Report):
    path: str
    status: Literal["ok", "refused"]
    prefix: str | None = Field(None, description="name of the prefix (ok only)")
    version: int | None = Field(None, description="prefix version (ok only)")
    tokens: int | None = Field(None, description="tokens in the bundle (ok only)")
    refusal: Refusal | None = Field(None, description="why it was refused (refused only)")


class VerifyTotals(Report):
    ok: int
    refused: int


class VerifyReport(Report):
    """`verify --json`: every bundle ok or refused, in argument order. Exit 1 if any is refused."""

    schema_: Literal["verify/1"] = Field("verify/1", alias="schema")
    model: str
    chat_template: str | None
    bundles: list[VerifiedBundle]
    totals: VerifyTotals


# --- inspect ---------------------------------------------------------------------------------


class CheckResult(Report):
    name: str = Field(description="validator stage, in the order the validator runs them")
    status: Literal["ok", "failed", "not-reached", "skipped"] = Field(
        description="skipped: the signature stage without --trusted-key, the identity stage "
        "without --model (a check not made is never shown as ok)"
    )
    detail: str = Field(description="what the stage establishes, or why it failed")


class SignatureReport(Report):
    key_id: str | None = Field(description="the signing key's id as minisign prints it")
    trusted_comment: str | None = Field(description="the signed comment: prefix@version model")
    problem: str | None = Field(description="why manifest.json.minisig cannot be read, if so")
    verified: bool = Field(
        description="true: it verified against a --trusted-key; false: not checked or refused"
    )


class Validity(Report):
    valid: bool
    for_model: str | None = Field(description="the --model folder; null: integrity only")
    refusal: Refusal | None = Field(description="the validator's refusal (the first problem)")
    refusals: list[Refusal] = Field(
        description="every reason found: each mismatching fingerprint at the identity stage, "
        "else the one refusal"
    )
    checks: list[CheckResult]


class InspectReport(Report):
    """`inspect --json`: the manifest's own fields at the top level, plus the validator's verdict.

    The manifest fields are null when manifest.json cannot be read (validity says why).
    Exit 1 when the bundle is refused.
    """

    schema_: Literal["inspect/1"] = Field("inspect/1", alias="schema")
    bundle: str
    files: dict[str, int] = Field(description="regular files in the bundle folder: bytes")
    format_version: Literal[2, 3, 4, 5] | None
    kind: Literal["prefix", "snapshot"] | None = Field(
        None,
        description='"prefix" or "snapshot" (serve --snapshots; format 3); null: format 2, or '
        "the manifest cannot be read",
    )
    prefix: PrefixInfo | None
    text: TextInfo | None
    tokens: TokenInfo | None
    model: ModelInfo | None
    cache: CacheInfo | None
    builder: BuilderInfo | None
    fidelity: FidelityInfo | None
    build_key: str | None
    parent: ParentInfo | None = Field(
        description="the bundle an incremental build continued at the exact shared token "
        "(parent.kind, parent.reused_tokens); null: built from token 0"
    )
    request: RequestInfo | None = Field(
        None,
        description="the prefix as a chat request, re-tokenized by serve --server NAME through "
        "NAME's own request code; null: built before requests were recorded, or with documents",
    )
    snapshot: SnapshotInfo | None = Field(
        None, description="a runtime snapshot's record (kind snapshot); null: a prefix bundle"
    )
    signature: SignatureReport | None = Field(
        None, description="manifest.json.minisig as written; null: the bundle is unsigned"
    )
    validity: Validity


# --- list ------------------------------------------------------------------------------------


class ListedBundle(Report):
    path: str
    model_folder: str | None = Field(
        None, description="<slug>-<fingerprint[:12]>; null when missing"
    )
    status: Literal["built", "missing", "broken"]
    tokens: int | None = None
    bytes: int | None = Field(None, description="cache.safetensors' size (built only)")
    refusal: Refusal | None = None


class ListedDefinition(Report):
    name: str = Field(description="the definition's file name without .toml")
    file: str
    status: Literal["ok", "broken"]
    version: int | None = Field(None, description="current version (ok only)")
    error: str | None = Field(None, description="why the definition is broken (broken only)")
    bundles: list[ListedBundle] = Field(
        description="bundles of the current version; one 'missing' entry when there are none"
    )


class ListTotals(Report):
    definitions: int
    broken_definitions: int
    built: int
    missing: int
    broken: int


class ListReport(Report):
    """`list --json`. Exit 1 when any definition or bundle is broken (missing is not an error)."""

    schema_: Literal["list/1"] = Field("list/1", alias="schema")
    prefixes: str
    bundles: str
    definitions: list[ListedDefinition]
    totals: ListTotals


# --- build -----------------------------------------------------------------------------------


class BuiltTarget(Report):
    prefix: str
    version: int
    model: str = Field(description="models.path, models.repo@revision, or the --model folder")
    status: Literal["built", "up-to-date", "failed"]
    path: str | None = Field(None, description="the bundle folder (null when failed)")
    tokens: int | None = None
    bytes: int | None = Field(None, description="size of cache.safetensors")
    prefill_seconds: float | None = Field(None, description="null when nothing was prefilled")
    tokens_per_second: float | None = Field(
        None, description="over the tokens this build prefilled (not those reused)"
    )
    reused_tokens: int | None = Field(
        None,
        description="tokens taken from a parent bundle instead of prefilled, the whole shared "
        "token prefix (0: none)",
    )
    error: str | None = Field(None, description="the `error:` line's text (failed only)")


class Shard(Report):
    index: int = Field(ge=1, description="1-based shard number")
    count: int = Field(ge=1)


class BuildTotals(Report):
    built: int
    up_to_date: int
    failed: int


class BuildReport(Report):
    """`build --json`. The build stops at the first error: `targets` lists what was done before it
    and the failed target; `error` repeats the `error:` line (also when no target was reached,
    e.g. a malformed definition or a --locked mismatch). Exit 1 when `error` is set.
    """

    schema_: Literal["build/1"] = Field("build/1", alias="schema")
    shard: Shard | None
    targets: list[BuiltTarget]
    totals: BuildTotals
    error: str | None


# --- prune -----------------------------------------------------------------------------------


class PrunedFolder(Report):
    path: str
    kind: Literal["older-version", "no-definition", "staging"]
    reason: str
    bytes: int = Field(description="bytes of the regular files in the folder")
    prefix: str | None = None
    version: int | None = None
    model_folder: str | None = None
    status: Literal["would-delete", "deleted", "failed"]
    error: str | None = Field(None, description="why it could not be deleted (failed only)")


class KeptFolder(Report):
    path: str
    prefix: str
    version: int
    model_folder: str
    reason: str = Field(description="why it is kept although retention would delete it")


class PruneTotals(Report):
    folders: int = Field(description="folders listed for deletion")
    bytes: int = Field(description="their bytes: what a dry run would reclaim")
    deleted: int
    deleted_bytes: int = Field(description="bytes reclaimed (with --apply)")
    failed: int


class PruneReport(Report):
    """`prune --json`: what is (or with --apply, was) deleted. Exit 1 when a deletion failed."""

    schema_: Literal["prune/1"] = Field("prune/1", alias="schema")
    bundles: str
    prefixes: str
    keep: int
    applied: bool
    delete: list[PrunedFolder]
    kept: list[KeptFolder]
    totals: PruneTotals
