"""Version discipline: the same prefix version never names two contents, and CI builds what is locked."""

from __future__ import annotations

from pathlib import Path

from pipeline.builder.definition import LoadedDefinition
from pipeline.format.bundle_folder import MANIFEST_FILE, read_manifest
from pipeline.format.errors import BuildError, BundleError
from pipeline.format.lockfile import LockedPrefix, LockError, Lockfile

NOT_A_PREFIX = 'runtime snapshot (kind "snapshot"), not a prefix bundle,'


def built_contents(bundles_root: Path, name: str, version: int) -> dict[Path, str]:
    """{bundle folder: content_sha256} of every bundle already built for this version."""
    folder = Path(bundles_root) / name / str(version)
    found = {}
    for bundle in sorted(folder.iterdir()) if folder.is_dir() else []:
        if not (bundle / MANIFEST_FILE).is_file():
            continue
        try:
            prefix = read_manifest(bundle, None).prefix
        except BundleError:
            continue  # a broken bundle proves nothing; it is rebuilt or reported by verify
        if prefix is not None:  # None: a runtime snapshot, no build of any version
            found[bundle] = prefix.content_sha256
    return found


def check_destination(dest: Path) -> None:
    """Refuse to replace what is not a prefix bundle (a runtime snapshot) where a build writes."""
    if not (dest / MANIFEST_FILE).is_file():
        return
    try:
        manifest = read_manifest(dest, None, kind=None)  # a snapshot here is refused below
    except BundleError:
        return  # a broken bundle is rebuilt in its place
    if manifest.prefix is None:
        raise BuildError(
            f"{dest}: holds a {NOT_A_PREFIX} where this build writes; "
            "move it out of the bundles folder (serve --snapshots keeps its own folder) and build "
            "again"
        )


def check_version(d: LoadedDefinition, bundles_root: Path, lock: Lockfile) -> None:
    """Refuse a content change without a version bump, against built bundles and the lockfile."""
    bump = f"bump version (now {d.version}) in {d.path}"
    locked = lock.prefixes.get(d.name)
    if locked is not None and d.version < locked.version:
        raise BuildError(
            f"{d.path}: version {d.version} is older than the locked version {locked.version}; {bump}"
        )
    if (
        locked is not None
        and locked.version == d.version
        and locked.content_sha256 != d.content_sha256
    ):
        raise BuildError(
            f"{d.path}: content changed since version {d.version} was locked in prefixes.lock "
            f"({locked.content_sha256[:12]}.. locked, {d.content_sha256[:12]}.. now); {bump}"
        )
    for bundle, content in built_contents(bundles_root, d.name, d.version).items():
        if content != d.content_sha256:
            raise BuildError(
                f"{d.path}: content changed since version {d.version} was built ({bundle}); {bump}"
            )


def check_locked(d: LoadedDefinition, lock: Lockfile, models: dict[str, str]) -> None:
    """For `build --locked`: the definition and its models are exactly as the lockfile says."""
    entry = lock.prefixes.get(d.name)
    fix = "run 'prefix-bundles build' and commit prefixes.lock"
    if entry is None:
        raise LockError(f"{d.path}: not in prefixes.lock; {fix}")
    now = LockedPrefix(
        version=d.version,
        content_sha256=d.content_sha256,
        template_sha256=d.spec.template.sha256,
        models={**entry.models, **models},
    )
    for field in ("version", "content_sha256", "template_sha256", "models"):
        was, is_ = getattr(entry, field), getattr(now, field)
        if was != is_:
            raise LockError(
                f"{d.path}: {field} differs from prefixes.lock ({was} locked, {is_} now); {fix}"
            )


def locked_entry(d: LoadedDefinition, models: dict[str, str]) -> LockedPrefix:
    """The lockfile entry a build of d for `models` ({model folder: fingerprint}) contributes
    (pipeline.format.lockfile.update_lock merges it with what the file holds then)."""
    return LockedPrefix(
        version=d.version,
        content_sha256=d.content_sha256,
        template_sha256=d.spec.template.sha256,
        models=models,
    )
