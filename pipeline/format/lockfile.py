"""prefixes/prefixes.lock: what each definition was last built as (version, content, template, models).

Written by `build`, checked by `build --locked` (CI), readable by `serve --lockfile` to mount exactly
the locked versions. A content change under the same version is refused against it, so version
discipline holds even where the old bundles are not on this machine.

A shared record: several builds may run at once, so each writes only its own definition's entry,
read-modify-write under a file lock held around that update alone (never around a prefill), and
never moves an entry another build wrote backwards (`merge_entry`). The lock is `flock` on
`.prefixes.lock.lock` beside the file: it holds between processes on one host and, on Linux, on NFS
v4 (flock is emulated with byte-range locks there); on a file system without working locks
(some SMB/FUSE mounts) two builds of one repository must not run at once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.format.bundle_folder import repeated_key
from pipeline.format.errors import PipelineError
from pipeline.format.names import MODEL_FOLDER_RULE, NAME_RULE
from pipeline.format.regular_files import FileProblem, read_regular
from pipeline.format.safe_files import PUBLIC_FILE, publish_file

LOCK_NAME = "prefixes.lock"
LOCK_VERSION = 1  # the lockfile layout this code reads and writes
Hex64 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Digest = Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")]
ModelFolder = Annotated[str, Field(pattern=MODEL_FOLDER_RULE)]  # <slug>-<fingerprint12>
PrefixName = Annotated[str, Field(pattern=NAME_RULE)]


class LockError(PipelineError):
    """The lockfile is unreadable, malformed, or does not match the definitions."""


class LockWriteError(LockError):
    """The lockfile (or its file lock) cannot be written: a read-only folder, a full disk."""


class LockedPrefix(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    version: Annotated[int, Field(ge=1)]
    content_sha256: Hex64
    template_sha256: Hex64
    models: dict[
        ModelFolder, Hex64
    ]  # model folder (slug-fingerprint prefix) -> full model fingerprint
    # model folder -> OCI artifact digest, recorded by `push --lockfile` (deploys pin by digest)
    artifacts: dict[ModelFolder, Digest] | None = None


class Lockfile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    lock_version: Annotated[int, Field(ge=LOCK_VERSION, le=LOCK_VERSION)] = LOCK_VERSION
    prefixes: dict[PrefixName, LockedPrefix] = Field(default_factory=dict)


def lock_path(prefix_dir: Path) -> Path:
    return Path(prefix_dir) / LOCK_NAME


def read_lock(path: Path) -> Lockfile:
    """The lockfile, or an empty one when nothing is there yet (a link to nothing is refused:
    read as empty, its pins would be dropped: prune would delete the bundles it keeps)."""
    path = Path(path)
    if not os.path.lexists(path):
        return Lockfile()
    if path.is_symlink() and not path.exists():
        raise LockError(
            f"{path}: is a link to {os.readlink(path)}, which does not exist; restore the "
            "lockfile it names, or remove the link"
        )
    try:
        data = read_regular(path, 16 << 20)
        lock = Lockfile.model_validate_json(data)
    except FileProblem as exc:
        raise LockError(f"{path}: {exc}") from None
    except ValidationError as exc:
        err = exc.errors()[0]
        where = repr(".".join(str(p) for p in err["loc"]))[1:-1] or "(top level)"
        if where == "lock_version":
            raise LockError(
                f"{path}: lock_version {err.get('input')!r} is not supported (this version reads "
                f"lock_version {LOCK_VERSION}, an integer); use the pipeline version that wrote it, or delete "
                "it and rebuild to write a new one"
            ) from None
        raise LockError(
            f"{path}: {where}: {err['msg']}; restore it from version control or delete it and rebuild"
        ) from None
    if (problem := repeated_key(data)) is not None:  # parsers disagree on which value counts
        raise LockError(
            f"{path}: {problem}; restore it from version control or delete it and rebuild"
        )
    return lock


def given_lock(path: Path) -> Lockfile:
    """A lockfile named on the command line: it must be there."""
    if not os.path.lexists(path):
        raise LockError(f"{path}: lockfile not found; pass the prefixes.lock your build wrote")
    return read_lock(path)


def _through_link(path: Path) -> Path:
    """The file a lockfile path names: a link's target is read, locked and rewritten (replacing
    the link by a file would leave the lockfile it names stale)."""
    return Path(os.path.realpath(path)) if Path(path).is_symlink() else Path(path)


def write_lock(path: Path, lock: Lockfile) -> None:
    """Write the lockfile atomically (sorted keys, trailing newline), through a link."""
    path = _through_link(path)
    text = json.dumps(lock.model_dump(mode="json", exclude_none=True), sort_keys=True, indent=2)
    text += "\n"
    try:
        publish_file(path, text.encode(), PUBLIC_FILE)
    except OSError as exc:
        raise LockWriteError(f"cannot write {path}: {exc.strerror}") from None


def update_lock(path: Path, name: str, entry: LockedPrefix) -> Lockfile:
    """Merge one definition's entry into the lockfile as it is on disk now, under its file lock;
    LockError when another build locked that definition at a newer version or other content."""
    from filelock import FileLock

    path = _through_link(path)
    try:
        with FileLock(str(path.with_name(f".{path.name}.lock"))):
            current = read_lock(path)
            merged = merge_entry(path, name, current.prefixes.get(name), entry)
            lock = current.model_copy(update={"prefixes": {**current.prefixes, name: merged}})
            write_lock(path, lock)
    except OSError as exc:  # the lock file cannot be created: the folder is read-only
        raise LockWriteError(f"cannot lock {path} for update: {exc.strerror}") from None
    return lock


def merge_entry(
    path: Path, name: str, now: LockedPrefix | None, built: LockedPrefix
) -> LockedPrefix:
    """The entry after a build: a newer version replaces, the same version and content adds its
    models; an entry another build moved on (newer version, or other content) is never reverted."""
    if now is None or now.version < built.version:
        return built
    if now.version > built.version:
        raise LockError(
            f"{path}: {name}@{now.version} was locked by another build while this one built "
            f"{name}@{built.version}; this build's entry is not recorded: build {name} again"
        )
    if (now.content_sha256, now.template_sha256) != (built.content_sha256, built.template_sha256):
        raise LockError(
            f"{path}: {name}@{built.version} was locked by another build with other content "
            f"({now.content_sha256[:12]}.. there, {built.content_sha256[:12]}.. here); "
            f"bump version of {name} and build it again"
        )
    artifacts = {**(now.artifacts or {}), **(built.artifacts or {})} or None
    return built.model_copy(
        update={"models": {**now.models, **built.models}, "artifacts": artifacts}
    )


def record_artifacts(path: Path, name: str, version: int, digests: dict[str, str]) -> None:
    """Add {model folder: OCI artifact digest} to the entry of name@version, under the file
    lock; LockError when the lockfile does not lock that version (push what it names)."""
    from filelock import FileLock

    path = _through_link(path)
    with FileLock(str(path.with_name(f".{path.name}.lock"))):
        lock = read_lock(path)
        now = locked_entry(path, lock, name, version)
        entry = now.model_copy(update={"artifacts": {**(now.artifacts or {}), **digests}})
        write_lock(path, lock.model_copy(update={"prefixes": {**lock.prefixes, name: entry}}))


def locked_entry(path: Path, lock: Lockfile, name: str, version: int) -> LockedPrefix:
    """The entry that locks name@version; LockError when the lockfile locks another or none."""
    now = lock.prefixes.get(name)
    if now is None or now.version != version:
        found = f"locks {name}@{now.version}" if now else f"does not name {name}"
        raise LockError(
            f"{path}: it {found}, not the pushed {name}@{version}; push the bundles the "
            "lockfile names (build --locked), or drop --lockfile"
        )
    return now


def locked_for_model(path: Path, fingerprint: str) -> dict[str, int]:
    """{prefix name: locked version} of the prefixes the lockfile records as built for the model
    with this fingerprint: what a deploy of that model must hold."""
    entries = read_lock(path).prefixes.items()
    return {name: e.version for name, e in entries if fingerprint in e.models.values()}


def locked_versions(path: Path) -> dict[str, int]:
    """{prefix name: locked version}, for mounting exactly what the lockfile names."""
    return {name: entry.version for name, entry in given_lock(path).prefixes.items()}


def locked_folders(path: Path) -> dict[str, frozenset[str]]:
    """{prefix name: the model folders its locked version was built in}: of one NAME@VERSION and
    model, mount takes the folder the lockfile names, never a sibling that would shadow it."""
    return {name: frozenset(e.models) for name, e in given_lock(path).prefixes.items()}
