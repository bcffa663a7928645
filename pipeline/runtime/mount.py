"""Mount bundles for a served model at startup: find them, pick the newest version, validate, load.

Every decision about validity is the validator's (pipeline.format.validate); this module only
finds candidate folders, chooses which version to mount, and collects results.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.format.bundle_folder import ALLOWED_FILES, STAGING_DIR
from pipeline.format.errors import BundleError
from pipeline.format.fingerprint import ModelIdentity, model_config, model_identity
from pipeline.format.identity import model_cache_classes
from pipeline.format.manifest import Manifest
from pipeline.format.validate import validate
from pipeline.runtime.prompt_cache import PromptCacheManager


@dataclass(frozen=True)
class MountedBundle:
    """A validated bundle loaded into memory."""

    path: Path
    manifest: Manifest
    tokens: list[int]
    cache: list[Any]
    seconds: float

    @property
    def name(self) -> str:
        return f"{self.manifest.prefix.name}@{self.manifest.prefix.version}"

    def date_warning(self, today: datetime.date) -> str | None:
        """Why requests rendered today may never share this bundle's prefix, if they may not."""
        pinned = self.manifest.model.template_date
        if pinned is None or pinned == today.isoformat():
            return None
        return (
            f"{self.name} was rendered with its template's date pinned to {pinned}; a server "
            f"rendering today's date ({today.isoformat()}) will not reuse it unless its prompts "
            "carry the same date (pin the date in the server's template, or rebuild daily)"
        )


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
    older: list[Path] = field(default_factory=list)  # valid or not, never mounted: a newer exists
    seconds: float = 0.0


MODEL_BUNDLES = "prefix-bundles"  # bundles deployed next to a model: <model>/prefix-bundles/


def model_bundles_dir(model_dir: Path) -> Path:
    """Where bundles copied next to a model live (same layout as bundles/): <model>/prefix-bundles."""
    return Path(model_dir) / MODEL_BUNDLES


def identity_for(model_dir: Path, chat_template: str | None = None) -> ModelIdentity:
    """Fingerprints of the served model, and the cache classes its architecture builds; pass the
    server's template override if it has one."""
    identity = model_identity(Path(model_dir), chat_template)
    classes = model_cache_classes(model_config(Path(model_dir)))
    return dataclasses.replace(
        identity, shape=dataclasses.replace(identity.shape, cache_classes=classes)
    )


def _is_bundle_folder(path: Path) -> bool:
    """Any bundle file name present, whatever it is: the validator decides what it is worth."""
    return any(os.path.lexists(path / name) for name in ALLOWED_FILES)


def find_bundles(root: Path) -> tuple[list[Path], list[Refusal]]:
    """Bundle folders under root (or root itself), and symlinks not followed (target outside root).

    Staging folders are skipped; a symlinked folder is followed only when it resolves inside root.
    """
    root = Path(root)
    if not root.is_dir():
        raise BundleError(
            str(root), "bundles folder does not exist; pass the folder the bundles were copied to"
        )
    if _is_bundle_folder(root):
        return [root], []
    real_root = root.resolve()
    found, problems, seen = [], [], {real_root}
    stack = [root]
    while stack:
        folder = stack.pop()
        for entry in sorted(os.scandir(folder), key=lambda e: e.name, reverse=True):
            path = Path(entry.path)
            if entry.is_symlink() and not path.exists():
                problems.append(Refusal(path, None, "broken symlink; not followed"))
                continue
            if entry.name == STAGING_DIR or not entry.is_dir(follow_symlinks=True):
                continue
            if entry.is_symlink():
                target = path.resolve()
                if not target.is_relative_to(real_root):
                    problems.append(
                        Refusal(
                            path,
                            None,
                            f"symlink to {target} outside the bundles root {root}; not followed",
                        )
                    )
                    continue
                if target in seen:
                    continue
                seen.add(target)
            (found if _is_bundle_folder(path) else stack).append(path)
    return sorted(found), problems


def version_key(root: Path, bundle: Path) -> tuple[tuple[str, str], int] | None:
    """((prefix name, model folder), version) for bundles/<name>/<version>/<model>, else None."""
    try:
        parts = bundle.relative_to(root).parts
    except ValueError:
        return None
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return (parts[0], parts[2]), int(parts[1])


def choose_versions(
    root: Path, paths: list[Path], versions: dict[str, int] | None = None
) -> tuple[list[Path], list[Path]]:
    """(to mount, older): per prefix and model the highest version, or the one `versions` names."""
    best: dict[tuple[str, str], int] = {}
    for path in paths:
        if (key := version_key(root, path)) is not None:
            (name, model), version = key
            pinned = (versions or {}).get(name)
            if pinned is None or version == pinned:
                best[(name, model)] = max(best.get((name, model), 0), version)
    chosen, older = [], []
    for path in paths:
        key = version_key(root, path)
        (chosen if key is None or best.get(key[0]) == key[1] else older).append(path)
    return chosen, older


def model_bundles(model_dir: Path) -> tuple[list[Path], list[Path], list[Refusal]]:
    """Every bundle in <model>/prefix-bundles: (newest per prefix and model, older, not followed).

    BundleError when the folder does not exist.
    """
    root = model_bundles_dir(model_dir)
    paths, problems = find_bundles(root)
    newest, older = choose_versions(root, paths)
    return newest, older, problems


def verify(bundle: Path, model_dir: Path, chat_template: str | None = None) -> Manifest:
    """Validate one bundle in full without loading it (for deploy scripts): hashes every byte."""
    return validate(Path(bundle), identity_for(model_dir, chat_template)).manifest


def mount_one(bundle: Path, identity: ModelIdentity, *, verify_full: bool = False) -> MountedBundle:
    """Validate and load one bundle, reading its cache file once."""
    start = time.perf_counter()
    v = validate(Path(bundle), identity, load=True, trust_memo=not verify_full)
    return MountedBundle(v.path, v.manifest, v.tokens, v.cache or [], time.perf_counter() - start)


def mount(
    model_dir: Path,
    bundles: Path | list[Path] | None = None,
    *,
    skip_refused: bool = False,
    chat_template: str | None = None,
    manager: PromptCacheManager | None = None,
    model_key: str | None = None,
    verify_full: bool = False,
    versions: dict[str, int] | None = None,
) -> MountResult:
    """Mount the newest version of every bundle found for the served model; refuse bad ones.

    `bundles` is a folder searched recursively (default: <model_dir>/prefix-bundles) or a list of
    bundle folders mounted as given.
    Raises BundleError for the first refused bundle unless skip_refused, which collects refusals.
    With a manager, mounted caches are pinned into it under `model_key` (default: model_dir).
    verify_full hashes every cache file even when the memo knows it; `versions` pins
    {prefix name: version} (from a lockfile) instead of the newest.
    """
    start = time.perf_counter()
    result = MountResult()
    identity = identity_for(model_dir, chat_template)
    bundles = model_bundles_dir(model_dir) if bundles is None else bundles
    paths, problems = [Path(b) for b in bundles] if isinstance(bundles, list) else [], []
    if not isinstance(bundles, list):
        try:
            paths, problems = find_bundles(Path(bundles))
        except BundleError as exc:
            _refuse(result, exc, skip_refused)
        paths, result.older = choose_versions(Path(bundles), paths, versions)
    for problem in problems:
        _refuse(result, BundleError(str(problem.path), problem.reason), skip_refused)
    for path in paths:
        try:
            result.bundles.append(mount_one(path, identity, verify_full=verify_full))
        except BundleError as exc:
            _refuse(result, exc, skip_refused)
    if manager is not None:
        key = model_key or str(model_dir)
        for b in result.bundles:
            manager.pin(key, b.tokens, b.cache, b.name)
    result.seconds = time.perf_counter() - start
    return result


def _refuse(result: MountResult, exc: BundleError, skip_refused: bool) -> None:
    if not skip_refused:
        raise exc
    result.refused.append(Refusal(Path(exc.bundle), exc.field, exc.reason))
