"""Mount bundles for a served model at startup: find them, pick the newest version, validate, load.

Every decision about validity is the validator's (pipeline.format.validate); this module only
finds candidate folders, chooses which version to mount, and collects results.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipeline.format.bundle_folder import FINGERPRINT_CHARS, model_folder
from pipeline.format.compat import cache_classes
from pipeline.format.errors import BundleError, PipelineError, path_argument
from pipeline.format.fingerprint import ModelIdentity
from pipeline.format.manifest import Manifest
from pipeline.format.served_identity import identity_for  # re-exported: pipeline.runtime's API
from pipeline.format.signature import PublicKey
from pipeline.format.validate import validate
from pipeline.runtime.bundle_tier import give_back
from pipeline.runtime.discovery import (  # noqa: F401  (re-exported: pipeline.runtime's API)
    Folders,
    RefusedBundle,
    choose,
    choose_versions,
    find_bundles,
    version_key,
)
from pipeline.runtime.prompt_cache import PromptCacheManager
from pipeline.runtime.shared_kv import PLAIN


@dataclass(frozen=True)
class MountedBundle:
    """A validated bundle loaded into memory."""

    path: Path
    manifest: Manifest
    tokens: list[int]
    cache: list[Any]
    seconds: float
    manifest_sha256: str = ""  # of the manifest bytes validated: what snapshots depend on
    # reads the bundle again as it was validated here (re-proved; BundleError if it changed):
    # what the disk tier of serve --bundle-memory reads on a hit
    read: Callable[[], list[Any]] | None = field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:
        return f"{self.manifest.prefix.name}@{self.manifest.prefix.version}"

    @property
    def precision(self) -> str:
        """The precision requests continue from: 'full precision (bfloat16)' or '8-bit KV'."""
        c = self.manifest.cache
        return f"{c.kv_bits}-bit KV" if c.kv_bits else f"full precision ({c.dtype})"

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


@dataclass
class MountResult:
    bundles: list[MountedBundle] = field(default_factory=list)
    refused: list[RefusedBundle] = field(default_factory=list)
    # valid or not, never mounted: a newer version (or the one the lockfile pins) is chosen
    older: list[Path] = field(default_factory=list)
    # valid, but the server's options mean requests would never use it (path, why): serve fills it
    unused: list[tuple[Path, str]] = field(default_factory=list)
    seconds: float = 0.0
    # the one-time imports a load needs (mlx-lm's cache classes pull transformers: ~1 s), paid
    # before the first bundle's clock starts so no bundle is charged for them; in `seconds` too
    import_seconds: float = 0.0


Pins = tuple[dict[str, int] | None, Folders | None]  # a lockfile's versions and model folders
MODEL_BUNDLES = "prefix-bundles"  # bundles deployed next to a model: <model>/prefix-bundles/


PROJECT_BUNDLES = Path("bundles")  # where build writes unless --bundles is given


def model_bundles_dir(model_dir: Path) -> Path:
    """Where bundles copied next to a model live (same layout as bundles/): <model>/prefix-bundles."""
    return Path(model_dir) / MODEL_BUNDLES


def reading_bundles_dir(model_dir: Path) -> tuple[Path, str | None]:
    """Where serve, match and verify read bundles when no --bundles is given, and a note when it
    is not the usual place: <model>/prefix-bundles, where a deploy copies them, else the
    project's bundles/ that build wrote (build then serve must not start cold unseen)."""
    near = model_bundles_dir(model_dir)
    if os.path.lexists(near) or not PROJECT_BUNDLES.is_dir():
        return near, None
    try:  # only a folder holding bundles built for this model is worth reading instead
        ours = "-" + identity_for(model_dir).model[:FINGERPRINT_CHARS]
        found = find_bundles(PROJECT_BUNDLES)[0]
    except PipelineError:  # the command names a bad model folder itself
        return near, None
    if not any(path.name.endswith(ours) for path in found):
        return near, None
    return PROJECT_BUNDLES, (
        f"no {near}: reading {PROJECT_BUNDLES}/, where build wrote bundles for this model; "
        "pass --bundles DIR to choose another folder"
    )


def model_bundles(model_dir: Path) -> tuple[list[Path], list[Path], list[RefusedBundle]]:
    """Every bundle in <model>/prefix-bundles: (newest per prefix and model, older, not followed).

    BundleError when the folder does not exist.
    """
    root = model_bundles_dir(model_dir)
    paths, problems = find_bundles(root)
    newest, older = choose_versions(root, paths)
    return newest, older, problems


def verify(
    bundle: Path,
    model_dir: Path,
    chat_template: str | None = None,
    *,
    trusted_keys: Sequence[PublicKey] = (),
) -> Manifest:
    """Validate one bundle in full without loading it (for deploy scripts): hashes every byte.

    With trusted_keys (pipeline.format.signature.read_trusted_keys) it must be signed by one."""
    bundle = path_argument(bundle, "verify: bundle")
    identity = identity_for(path_argument(model_dir, "verify: model_dir"), chat_template)
    return validate(bundle, identity, trusted_keys=trusted_keys).manifest


def mount_one(
    bundle: Path,
    identity: ModelIdentity,
    *,
    verify_full: bool = False,
    trusted_keys: Sequence[PublicKey] = (),
    load: bool = True,
) -> MountedBundle:
    """Validate and load one bundle, reading its cache file once (`load=False`: validated in full,
    its token ids read, no tensor loaded; `cache` is empty and `read` loads it)."""
    start = time.perf_counter()
    v = validate(
        Path(bundle), identity, load=load, trust_memo=not verify_full, trusted_keys=trusted_keys
    )
    seconds = time.perf_counter() - start
    read = _reader(v.path, identity, tuple(trusted_keys), v.manifest_sha256)
    return MountedBundle(
        v.path, v.manifest, v.tokens, v.cache or [], seconds, v.manifest_sha256, read
    )


def _reader(
    path: Path, identity: ModelIdentity, keys: tuple[PublicKey, ...], manifest_sha256: str
) -> Callable[[], list[Any]]:
    """The bundle's cache, read again through the one validator (the memo vouches for a file
    unchanged by its stat, else every byte is hashed), and only the manifest validated here:
    BundleError when the folder was deleted, truncated, altered or replaced, even by another
    valid bundle."""

    def read() -> list[Any]:
        v = validate(path, identity, load=True, trust_memo=True, trusted_keys=keys)
        if v.manifest_sha256 != manifest_sha256:
            raise BundleError(
                str(path),
                "was replaced since it was mounted (another manifest.json); this process serves "
                "only what it mounted: remount (SIGHUP) to serve the new one",
                "manifest",
            )
        return v.cache or []

    return read


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
    trusted_keys: Sequence[PublicKey] = (),
    identity: ModelIdentity | None = None,
    required: Mapping[str, int] | None = None,
    folders: Folders | None = None,
) -> MountResult:
    """Mount the newest version of every bundle found for the served model; refuse bad ones.

    `bundles` is a bundles folder, searched at <name>/<version>/<model folder> only (default:
    <model_dir>/prefix-bundles; anything else there is refused, never mounted), one bundle folder,
    or a list of bundle folders; the newest-only and `versions` rules apply to all of them.
    Raises BundleError for the first refused bundle unless skip_refused, which collects refusals.
    With a manager, mounted caches are pinned into it under `model_key` (default: model_dir);
    `release_caches(result)` then lets the manager alone hold them (a shared preamble once). A
    manager with a `bundle_memory` budget gets the bundles validated without loading them (their
    `cache` stays empty; `read` loads it); those of plain K/V layers wait on disk and are read
    while the budget holds them (`PromptCacheManager.fill`), the others are loaded and held.
    verify_full hashes every cache file even when the memo knows it; `versions` pins
    {prefix name: version} (from a lockfile) instead of the newest, and mounts no other prefix.
    With trusted_keys every bundle must carry a valid signature by one of them (the version rules
    then apply to signed manifests, so an older signed version copied back stays unmounted).
    `identity`: the served model's, when the caller read it already (serve: the weights it runs).
    `required`: {prefix name: version} the deploy must hold (a lockfile's pins for this model,
    lockfile.locked_for_model): each one neither mounted nor refused is refused (field lockfile).
    `folders`: {prefix name: model folders} a lockfile names (lockfile.locked_folders): of one
    NAME@VERSION and model the folder it names is mounted; without one, two folders that would
    shadow each other are both refused.
    """
    _check_arguments(model_dir, bundles, versions, required, manager, folders)
    start = time.perf_counter()
    result = MountResult()
    identity = identity or identity_for(model_dir, chat_template)
    bundles = model_bundles_dir(model_dir) if bundles is None else bundles
    paths = [Path(b) for b in bundles] if isinstance(bundles, list) else []
    if not isinstance(bundles, list):
        paths = _found(result, Path(bundles), (versions, folders), skip_refused)
    if paths:
        began = time.perf_counter()
        cache_classes()  # imports mlx_lm once, here, not inside the first bundle's mount time
        result.import_seconds = time.perf_counter() - began
    tiered = manager is not None and manager.bundle_memory is not None
    for path in paths:
        try:
            mounted = mount_one(
                path, identity, verify_full=verify_full, trusted_keys=trusted_keys, load=not tiered
            )
            result.bundles.append(mounted)
        except BundleError as exc:
            _refuse(result, exc, skip_refused)
    _keep_chosen(result, (versions, folders), skip_refused)
    if required and not isinstance(bundles, list):
        _require(result, Path(bundles), required, skip_refused)
    if manager is not None:
        _pin_all(result, manager, model_key or str(Path(model_dir)), skip_refused)
    result.seconds = time.perf_counter() - start
    return result


def release_caches(result: MountResult) -> None:
    """Let the manager the bundles were pinned into hold their caches alone: each mounted
    bundle's own `cache` is dropped (`read` loads it again) and the memory no entry holds is
    given back (a preamble shared by several bundles is then held once: serve calls this)."""
    result.bundles[:] = [replace(b, cache=[]) for b in result.bundles]
    give_back()


def _pin_all(
    result: MountResult, manager: PromptCacheManager, key: str, skip_refused: bool
) -> None:
    """Pin every mounted bundle (on disk where the budget says, when its layers are plain K/V)."""
    tiered = manager.bundle_memory is not None
    dropped: list[MountedBundle] = []
    for b in result.bundles:
        if tiered and set(b.manifest.cache.classes) <= PLAIN:
            lossy = b.manifest.cache.kv_bits is not None
            nbytes = b.manifest.cache.nbytes
            manager.pin_on_disk(key, b.tokens, b.name, reload=b.read, nbytes=nbytes, lossy=lossy)
            continue
        try:  # a bundle validated without its tensors (budget) is loaded here
            cache = b.cache if b.cache or b.read is None else b.read()
        except BundleError as exc:
            dropped.append(b)
            _refuse(result, exc, skip_refused)
            continue
        manager.pin(key, b.tokens, cache, b.name, reload=b.read)
    result.bundles = [b for b in result.bundles if all(b is not d for d in dropped)]
    if tiered:
        manager.fill(key)
        give_back()  # what a bundle loaded to be compared held beyond its own tail


def _check_arguments(
    model_dir: Any, bundles: Any, versions: Any, required: Any, manager: Any, folders: Any = None
) -> None:
    """PipelineError naming an argument of the wrong kind (a caller's mistake, not a bundle's:
    never a TypeError from deep inside, never a refusal blaming a good bundle)."""
    paths = bundles if isinstance(bundles, list) else [bundles] if bundles is not None else []
    for name, value in (("model_dir", model_dir), *(("bundles", b) for b in paths)):
        path_argument(value, f"mount: {name}")
    for name, pins in (("versions", versions), ("required", required)):
        if pins is None:
            continue
        if not isinstance(pins, Mapping) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
            for k, v in pins.items()
        ):
            raise PipelineError(f"mount: {name} must map prefix names to version numbers (int)")
    if folders is not None and not (
        isinstance(folders, Mapping)
        and all(
            isinstance(k, str) and not isinstance(v, str) and all(isinstance(f, str) for f in v)
            for k, v in folders.items()
        )
    ):
        raise PipelineError("mount: folders must map prefix names to model folder names (str)")
    if manager is not None and not isinstance(manager, PromptCacheManager):
        raise PipelineError(
            f"mount: manager must be a PromptCacheManager, got {type(manager).__name__}"
        )


def _found(result: MountResult, root: Path, pins: Pins, skip_refused: bool) -> list[Path]:
    """The bundles under root to validate: layout only, newest or locked; the rest is reported."""
    try:
        paths, problems = find_bundles(root)
    except BundleError as exc:
        _refuse(result, exc, skip_refused)
        return []
    for problem in problems:
        _refuse(result, BundleError(str(problem.path), problem.reason, problem.field), skip_refused)
    keys = {}
    for path in paths:
        if (key := version_key(root, path)) is not None:
            keys[path] = (*key[0], key[1])
    chosen = _apply(result, keys, pins, skip_refused)
    return sorted(chosen + [p for p in paths if p not in keys])


def _apply(
    result: MountResult, keys: dict[Path, tuple[str, str, int]], pins: Pins, skip_refused: bool
) -> list[Path]:
    """The version and lockfile rules over keys: what is chosen; the rest is older or refused."""
    c = choose(keys, *pins)
    result.older += [p for p in c.older if p not in result.older]
    for path in c.unlocked:
        _refuse(result, _unlocked(path, keys[path][0], pins[0] or {}), skip_refused)
    for path, why in sorted(c.refused.items()):
        _refuse(
            result, BundleError(str(path), why, "lockfile" if pins[1] else "layout"), skip_refused
        )
    return c.chosen


def _keep_chosen(result: MountResult, pins: Pins, skip_refused: bool) -> None:
    """Apply the newest-only and lockfile rules to what was mounted, by manifest (this covers
    bundles given as folders, which no layout names)."""
    keys = {}
    for b in result.bundles:
        p, m = b.manifest.prefix, b.manifest.model
        keys[b.path] = (p.name, model_folder(m.slug, m.fingerprint), p.version)
    chosen = _apply(result, keys, pins, skip_refused)
    result.bundles = [b for b in result.bundles if b.path in chosen]


def _require(
    result: MountResult, root: Path, required: Mapping[str, int], skip_refused: bool
) -> None:
    """Refuse each required prefix version that was neither mounted nor refused: a lockfile pin
    the deploy lacks would otherwise be served cold without a word."""
    seen = {(b.manifest.prefix.name, b.manifest.prefix.version) for b in result.bundles}
    for refused in result.refused:
        if (key := version_key(root, refused.path)) is not None:
            seen.add((key[0][0], key[1]))
    for name, version in sorted(required.items()):
        if (name, version) not in seen:
            reason = (
                f"the lockfile pins {name}@{version} for this model, but no bundle of it is in "
                f"{root}; deploy it (build, push/pull or copy {name}/{version}/), or serve with "
                "the lockfile of what is deployed"
            )
            _refuse(
                result,
                BundleError(str(root / name / str(version)), reason, "lockfile"),
                skip_refused,
            )


def _unlocked(path: Path, name: str, versions: dict[str, int]) -> BundleError:
    pins = ", ".join(f"{n}@{v}" for n, v in sorted(versions.items())) or "nothing"
    return BundleError(
        str(path),
        f"prefix {name} is not in the lockfile (it pins {pins}); not mounted: build {name} so "
        "the lockfile names it, or serve without --lockfile",
        "lockfile",
    )


def _refuse(result: MountResult, exc: BundleError, skip_refused: bool) -> None:
    if not skip_refused:
        raise exc
    result.refused.append(RefusedBundle(Path(exc.bundle), exc.field, exc.reason))
