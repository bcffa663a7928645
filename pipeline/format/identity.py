"""Does a bundle fit the served model: weights, tokenizer and chat template fingerprints."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.format.bundle_folder import refuse
from pipeline.format.cache_state import model_cache_classes
from pipeline.format.errors import BundleError
from pipeline.format.fingerprint import ModelIdentity
from pipeline.format.manifest import Manifest


@dataclass(frozen=True)
class IdentityCheck:
    """One fingerprint comparison between a bundle and the served model."""

    field: str
    what: str
    expected: str | None  # what the bundle was built for
    found: str | None  # what the served model has
    fix: str

    @property
    def ok(self) -> bool:
        return self.expected == self.found

    def error(self, bundle: Path) -> BundleError:
        exp, got = (self.expected or "none")[:16], (self.found or "none")[:16]
        message = f"{self.what} mismatch (bundle expects {exp}.., model has {got}..); {self.fix}"
        return refuse(bundle, message, self.field)


def identity_checks(manifest: Manifest, identity: ModelIdentity) -> list[IdentityCheck]:
    """The comparisons that decide whether a bundle fits the served model, in refusal order."""
    m = manifest.model
    rebuild = (
        f"rebuild it with 'prefix-bundles build {manifest.prefix.name} --model <this model>'"
        if manifest.prefix is not None
        else "a snapshot is used only by the model that wrote it (serve writes a new one at its next stop)"
    )
    never_hit = (
        "the server renders prompts with another template, so this bundle could never be hit; "
        f"serve with the bundle's template (--chat-template) or {rebuild}"
    )
    return [
        IdentityCheck("model.fingerprint", "model weights/config", m.fingerprint, identity.model, rebuild),
        IdentityCheck("model.tokenizer_fingerprint", "tokenizer", m.tokenizer_fingerprint, identity.tokenizer, rebuild),
        IdentityCheck("model.template_sha256", "chat template", m.template_sha256, identity.template, never_hit),
    ]  # fmt: skip


def check_identity(bundle: Path, manifest: Manifest, identity: ModelIdentity) -> None:
    """Refuse a bundle whose weights, tokenizer or template differ from the served model."""
    for check in identity_checks(manifest, identity):
        if not check.ok:
            raise check.error(bundle)


__all__ = ["IdentityCheck", "check_identity", "identity_checks", "model_cache_classes"]
