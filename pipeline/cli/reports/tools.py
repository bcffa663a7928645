"""The `--json` documents of the key and set-up commands: keygen, sign, demo, server-env."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.cli.reports.base import Report


class KeygenReport(Report):
    """`keygen --json`: the key pair written."""

    schema_: Literal["keygen/1"] = Field("keygen/1", alias="schema")
    key_id: str = Field(description="the public key's id (minisign's, 16 hex digits)")
    secret_key: str = Field(description="path of the secret key file (mode 0600)")
    public_key: str = Field(description="path of the public key file: pass it with --trusted-key")
    encrypted: bool = Field(description="whether the secret key is encrypted with a password")


class SignedBundle(Report):
    path: str
    status: Literal["signed", "already-signed", "refused"]
    trusted_comment: str | None = Field(description="the signature's trusted comment")
    replaced: str | None = Field(description="key id of the signature this one replaced")
    vouches_for: str | None = Field(description="what the signature vouches for")
    error: str | None = Field(description="why it was not signed (refused only)")


class SignTotals(Report):
    signed: int
    already_signed: int
    refused: int


class SignReport(Report):
    """`sign --json`. Exit 1 when any bundle was refused."""

    schema_: Literal["sign/1"] = Field("sign/1", alias="schema")
    key_id: str = Field(description="the signing key's id")
    bundles: list[SignedBundle] = Field(description="in argument order")
    totals: SignTotals


class DemoBundle(Report):
    prefix: str
    status: Literal["built", "up to date"]
    tokens: int
    bytes: int = Field(description="the bundle folder's files, in bytes")
    prefill_seconds: float | None = Field(description="null when its build report is missing")
    build_seconds: float | None = Field(
        None,
        description="the whole build (prefill, fidelity check, write, self-check); null "
        "when its build report is missing or predates the field",
    )
    mount_ms: float = Field(description="milliseconds to mount it (verified, loaded)")


class DemoReport(Report):
    """`demo --json`: every example prefix built for the demo model, verified and mounted."""

    schema_: Literal["demo/1"] = Field("demo/1", alias="schema")
    model: str
    bundles_dir: str
    bundles: list[DemoBundle]


class ServerEnvReport(Report):
    """`server-env --json`: the virtual environment made (or, with --dry-run, how)."""

    schema_: Literal["server-env/1"] = Field("server-env/1", alias="schema")
    dir: str
    servers: list[str]
    status: Literal["made", "ready", "dry-run"] = Field(
        description="made now; ready: it already imported them; dry-run: nothing was run"
    )
    commands: list[str] = Field(description="the shell lines that make it (run unless ready)")
    versions: str | None = Field(description="mlx-lm's and each server's version in the venv")
