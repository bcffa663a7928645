"""Manifest schema v1: everything a bundle's validity depends on, as a frozen pydantic record."""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict

FORMAT_VERSION = 1


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PrefixInfo(Record):
    name: str
    version: int
    content_sha256: str


class TextInfo(Record):
    sha256: str
    chars: int
    preview: str  # first and last characters of the rendered prefix


class TokenInfo(Record):
    count: int  # tokens stored in the bundle (the stable prefix)
    ids_sha256: str
    rendered_tokens: int  # tokens of the rendered prefix before the stability cut
    stable_tokens: int


class ModelInfo(Record):
    slug: str
    fingerprint: str
    tokenizer_fingerprint: str
    template_sha256: str
    template_source: str  # "model" or "file:<name>"


class CacheInfo(Record):
    classes: list[str]
    dtype: str
    kv_bits: int | None
    kv_group_size: int
    prefill_step_size: int
    nbytes: int


class BuilderInfo(Record):
    pipeline: str
    mlx: str
    mlx_lm: str
    platform: str
    device: str
    compute_dtype: str


class FidelityInfo(Record):
    checked: bool
    max_abs_logit_diff: float | None = None
    threshold: float | None = None
    greedy_tokens: int | None = None
    greedy_match: bool | None = None
    probe: str | None = None


class Manifest(Record):
    """Everything a bundle's validity depends on; deterministic for identical inputs."""

    format_version: int
    prefix: PrefixInfo
    text: TextInfo
    tokens: TokenInfo
    model: ModelInfo
    cache: CacheInfo
    builder: BuilderInfo
    fidelity: FidelityInfo
    build_key: str


def manifest_bytes(manifest: Manifest) -> bytes:
    """Canonical manifest bytes: sorted keys, two-space indent, trailing newline."""
    return (json.dumps(manifest.model_dump(mode="json"), sort_keys=True, indent=2) + "\n").encode()
