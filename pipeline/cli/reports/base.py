"""What every `--json` document shares: the strict base model and the validator's refusal."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Report(BaseModel):
    """Strict and closed: the schema says exactly what a consumer can rely on."""

    model_config = ConfigDict(
        extra="forbid", strict=True, json_schema_serialization_defaults_required=True
    )


class Refusal(Report):
    """Why the validator refused a bundle: the field, the stage that refused it, and the fix."""

    field: str | None = Field(description="manifest field or file name, when one is to blame")
    check: str | None = Field(
        description="validator stage (files, checksums, location, mlx-lm, identity, cache file, "
        "layout, tokens, data); null when the bundle could not be read as one"
    )
    reason: str = Field(
        description="what is wrong and what to do (the `error:` line after the bundle)"
    )


def refusal_of(exc: Exception) -> Refusal:
    """A refusal from the validator's BundleError (or any other expected error, stage unknown)."""
    reason = getattr(exc, "reason", None) or str(exc)
    return Refusal(
        field=getattr(exc, "field", None), check=getattr(exc, "check", None), reason=reason
    )
