"""Thin runtime loader for servers: verify bundles against the served model and mount them.

Importing this module must stay cheap: no jinja2, no template rendering, no build path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.bundle import (
    MANIFEST_FILE,
    STAGING_DIR,
    SUMS_FILE,
    load_cache,
    parse_sums,
    read_manifest,
    verify_files,
)
from pipeline.errors import BundleError, PipelineError
from pipeline.fingerprint import ModelIdentity, canonical_json, model_identity, sha256_bytes
from pipeline.manifest import Manifest
from pipeline.prompt_cache import CacheHit, PromptCacheManager

__all__ = [
    "BundleError",
    "CacheHit",
    "MountResult",
    "MountedBundle",
    "PipelineError",
    "PromptCacheManager",
    "Refusal",
    "find_bundles",
    "identity_for",
    "mount",
    "verify",
]

# mlx-lm releases whose prompt-cache layout (save_prompt_cache / from_state) we have tested.
SUPPORTED_MLX_LM = ((0, 30), (0, 33))
SUPPORTED_RANGE = ">=0.30,<0.33"  # the same range, as pip writes it (pyproject pins it too)


def mlx_lm_supported(version: str) -> bool:
    """Whether an mlx-lm version string falls in SUPPORTED_MLX_LM."""
    parts = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
    low, high = SUPPORTED_MLX_LM
    return low <= parts < high


@dataclass(frozen=True)
class MountedBundle:
    """A verified bundle loaded into memory."""

    path: Path
    manifest: Manifest
    tokens: list[int]
    cache: list[Any]
    seconds: float

    @property
    def name(self) -> str:
        return f"{self.manifest.prefix.name}@{self.manifest.prefix.version}"


@dataclass(frozen=True)
class Refusal:
    """Why a bundle was not mounted."""

    path: Path
    field: str | None
    reason: str


@dataclass
class MountResult:
    bundles: list[MountedBundle] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    seconds: float = 0.0


def identity_for(model_dir: Path, chat_template: str | None = None) -> ModelIdentity:
    """Fingerprints of the served model; pass the server's template override if it has one."""
    return model_identity(Path(model_dir), chat_template)


def find_bundles(root: Path) -> list[Path]:
    """Bundle folders under root (or root itself), sorted; staging leftovers are ignored."""
    root = Path(root)
    if (root / MANIFEST_FILE).is_file() or (root / SUMS_FILE).is_file():
        return [root]
    found = {p.parent for p in root.rglob(MANIFEST_FILE)} | {
        p.parent for p in root.rglob(SUMS_FILE)
    }
    return sorted(p for p in found if STAGING_DIR not in p.relative_to(root).parts)


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
        return BundleError(str(bundle), message, self.field)


def identity_checks(manifest: Manifest, identity: ModelIdentity) -> list[IdentityCheck]:
    """The comparisons that decide whether a bundle fits the served model, in refusal order."""
    m = manifest.model
    rebuild = f"rebuild it with 'python build.py build {manifest.prefix.name} --model <this model>'"
    never_hit = (
        "the server renders prompts with another template, so this bundle could never be hit; "
        f"serve with the bundle's template (--chat-template) or {rebuild}"
    )
    return [
        IdentityCheck(
            "model.fingerprint", "model weights/config", m.fingerprint, identity.model, rebuild
        ),
        IdentityCheck(
            "model.tokenizer_fingerprint",
            "tokenizer",
            m.tokenizer_fingerprint,
            identity.tokenizer,
            rebuild,
        ),
        IdentityCheck(
            "model.template_sha256",
            "chat template",
            m.template_sha256,
            identity.template,
            never_hit,
        ),
    ]


def check_identity(bundle: Path, manifest: Manifest, identity: ModelIdentity) -> None:
    """Refuse a bundle whose weights, tokenizer or template differ from the served model."""
    for check in identity_checks(manifest, identity):
        if not check.ok:
            raise check.error(bundle)


def check_runtime(bundle: Path, manifest: Manifest) -> None:
    """Refuse a bundle this installation cannot load faithfully."""
    from mlx_lm import __version__ as installed

    for label, version in (
        ("installed mlx-lm", installed),
        ("bundle's mlx-lm", manifest.builder.mlx_lm),
    ):
        if not mlx_lm_supported(version):
            raise BundleError(
                str(bundle),
                f"{label} {version} is outside the supported range {SUPPORTED_RANGE}; "
                "install a supported mlx-lm",
                "builder.mlx_lm",
            )


def verify(bundle: Path, model_dir: Path, chat_template: str | None = None) -> Manifest:
    """Full check without loading: checksums, manifest, fingerprints (for deploy scripts)."""
    bundle = Path(bundle)
    manifest = verify_files(bundle)
    check_runtime(bundle, manifest)
    check_identity(bundle, manifest, identity_for(model_dir, chat_template))
    return manifest


def mount_one(bundle: Path, identity: ModelIdentity) -> MountedBundle:
    """Verify and load one bundle, reading its cache file once."""
    start = time.perf_counter()
    bundle = Path(bundle)
    if not bundle.is_dir():
        raise BundleError(str(bundle), "not a bundle folder (does not exist)")
    sums = parse_sums(bundle)
    manifest = read_manifest(bundle, sums)
    check_runtime(bundle, manifest)
    check_identity(bundle, manifest, identity)
    cache, tokens = load_cache(bundle, sums["cache.safetensors"])
    if (
        sha256_bytes(canonical_json(tokens)) != manifest.tokens.ids_sha256
        or len(tokens) != manifest.tokens.count
    ):
        raise BundleError(
            str(bundle),
            "token ids in cache.safetensors do not match the manifest",
            "tokens.ids_sha256",
        )
    classes = [type(c).__name__ for c in cache]
    if classes != manifest.cache.classes:
        raise BundleError(
            str(bundle), f"cache classes {classes} differ from the manifest", "cache.classes"
        )
    return MountedBundle(bundle, manifest, tokens, cache, time.perf_counter() - start)


def mount(
    model_dir: Path,
    bundles: Path | list[Path],
    *,
    skip_refused: bool = False,
    chat_template: str | None = None,
    manager: PromptCacheManager | None = None,
    model_key: str | None = None,
) -> MountResult:
    """Mount every bundle found for the served model; refuse (or, if asked, skip) bad ones.

    With a manager, mounted caches are pinned into it under `model_key` (default: model_dir).
    """
    start = time.perf_counter()
    identity = identity_for(model_dir, chat_template)
    paths = (
        find_bundles(bundles) if isinstance(bundles, (str, Path)) else [Path(b) for b in bundles]
    )
    result = MountResult()
    for path in paths:
        try:
            result.bundles.append(mount_one(path, identity))
        except BundleError as exc:
            if not skip_refused:
                raise
            result.refused.append(Refusal(path, exc.field, exc.reason))
    if manager is not None:
        key = model_key or str(model_dir)
        for b in result.bundles:
            manager.pin(key, b.tokens, b.cache, b.name)
    result.seconds = time.perf_counter() - start
    return result
