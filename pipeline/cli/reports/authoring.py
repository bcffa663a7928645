"""The `--json` document of `match`: which bundle serve would use for a request, and why."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.cli.reports.base import Report


class MatchedBundle(Report):
    name: str = Field(description="<prefix>@<version>")
    path: str
    bundle_tokens: int
    common_tokens: int = Field(description="leading tokens the request shares with the bundle")
    reused_tokens: int = Field(description="what serve's reuse rule lets this bundle serve")
    lossy: bool = Field(description="quantized KV: served only for its share of the bundle")
    chosen: bool = Field(description="the bundle serve would use for this request")
    why: str = Field(description="why serve uses it, or why it loses")
    divergence: str | None = Field(description="where the request and the bundle part; null: never")


class MatchReport(Report):
    """`match --json`. Exit 1 when serve would run the request cold or reuse less than
    --min-share of the chosen bundle."""

    schema_: Literal["match/1"] = Field("match/1", alias="schema")
    server: str = Field(description="whose request code tokenized the request")
    api: Literal["openai", "anthropic"]
    request_tokens: int
    chosen: str | None = Field(description="the bundle serve would use; null: none (cold)")
    bundles: list[MatchedBundle] = Field(description="every valid bundle, best first")
    not_considered: list[str] = Field(description="bundles refused by the validator, and why")
    share: float = Field(0.0, description="the chosen bundle's tokens serve reuses, 0-1 (0: cold)")
    min_share: float = Field(0.5, description="--min-share, 0-1")
    passed: bool = Field(False, description="share >= min_share: the exit status is 0")


class NewReport(Report):
    """`new --json`: the definition written, its size, and whether this environment builds it."""

    schema_: Literal["new/1"] = Field("new/1", alias="schema")
    name: str
    path: str = Field(description="the .toml written (its files in the folder of the same name)")
    model: str
    api: Literal["openai", "anthropic"]
    servers: list[str] = Field(description="whose request code gives the ids; [] the template's")
    tokens: int = Field(description="tokens of the prefix as the pinned template renders it")
    notes: list[str] = Field(description="what a captured request had that was left out")
    buildable: str | None = Field(
        description="why this environment cannot build it, or why build would refuse it as it is "
        "(a turn the template drops, too few stable tokens); null: it can be built"
    )
