"""Retention: which bundle folders and staging leftovers `prune` may delete, and deleting them.

No printing. A plan lists, under a bundles root in the <name>/<version>/<model folder> layout:
versions older than the newest `keep` per (prefix, model folder); every bundle of a prefix whose
definition file is gone; staging folders whose process is gone. A version that prefixes.lock names
is never deleted. Symlinks are neither followed nor removed, and nothing outside the layout is
touched. A bundle is deleted by renaming it into the staging folder first (one atomic rename, so
the bundle path never names a half-deleted bundle) and then removing it.
"""

from __future__ import annotations

import os
import secrets
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pipeline.builder.definition import DefinitionError, find_definitions, read_definition
from pipeline.builder.writer import abandoned_staging, is_abandoned, staging_root, target_lock
from pipeline.format.bundle_folder import (
    CACHE_FILE,
    MANIFEST_FILE,
    check_folder,
    read_manifest,
    read_sums,
)
from pipeline.format.errors import BundleError, PipelineError
from pipeline.format.lockfile import lock_path, read_lock
from pipeline.format.names import is_model_folder, is_name, parse_version
from pipeline.format.safe_tree import (
    is_link_or_missing,
    make_folders,
    remove_empty,
    remove_tree,
    rename,
    tree_bytes,
)

Kind = Literal["older-version", "no-definition", "staging"]


@dataclass(frozen=True)
class Candidate:
    """A folder prune would delete, and why."""

    path: Path
    kind: Kind
    reason: str
    bytes: int
    prefix: str | None = None
    version: int | None = None
    model_folder: str | None = None


@dataclass(frozen=True)
class Kept:
    """A folder that would be deleted but is kept: prefixes.lock names its version."""

    path: Path
    prefix: str
    version: int
    model_folder: str
    reason: str


@dataclass
class Plan:
    delete: list[Candidate] = field(default_factory=list)
    kept: list[Kept] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.delete)


LEFT = "left"  # _doomed's kind for a folder prune never deletes (it says why)


@dataclass(frozen=True)
class Bundle:
    path: Path
    prefix: str
    version: int
    model_folder: str


def plan(bundles_root: Path, prefixes: Path, keep: int = 1) -> Plan:
    """What prune would delete under bundles_root (PipelineError when it cannot tell safely)."""
    if keep < 1:
        raise PipelineError(f"--keep {keep}: keep at least 1 version; pass --keep 1 or more")
    root = Path(bundles_root)
    if not root.is_dir():
        raise PipelineError(f"bundles folder {root} does not exist; pass --bundles")
    defined = _defined(prefixes)
    if not defined:
        raise PipelineError(
            f"no prefix definitions (*.toml) in {prefixes}/; pass --prefixes (prune deletes the "
            "bundles of prefixes without a definition, so it needs the definitions)"
        )
    lock_file = lock_path(prefixes)
    locked = {name: entry.version for name, entry in read_lock(lock_file).prefixes.items()}
    result = Plan()
    for b, kind, reason in _doomed(layout_bundles(root), defined, keep, prefixes):
        if kind == LEFT:
            result.kept.append(Kept(b.path, b.prefix, b.version, b.model_folder, reason))
        elif locked.get(b.prefix) == b.version:
            why = f"version {b.version} of {b.prefix} is named in {lock_file}"
            result.kept.append(Kept(b.path, b.prefix, b.version, b.model_folder, why))
        else:
            size = tree_bytes(root, b.path)
            result.delete.append(
                Candidate(b.path, kind, reason, size, b.prefix, b.version, b.model_folder)
            )
    for tmp in abandoned_staging(root):
        reason = f"staging folder of process {tmp.name.split('-', 1)[0]}, which is gone"
        result.delete.append(Candidate(tmp, "staging", reason, tree_bytes(root, tmp)))
    return result


def _defined(prefixes: Path) -> set[str]:
    """The prefix names defined in prefixes/; PipelineError when a *.toml there is not a
    definition (a wrong --prefixes, such as a project root with pyproject.toml, would otherwise
    make every bundle one of a prefix without a definition)."""
    if not Path(prefixes).is_dir():
        return set()
    try:
        return {read_definition(p).name for p in find_definitions(prefixes)}
    except DefinitionError as exc:
        raise PipelineError(
            f"{exc}; prune deletes the bundles of prefixes without a definition, so it reads "
            "every definition first: fix that file or pass the right --prefixes"
        ) from None


def _doomed(bundles: list[Bundle], defined: set[str], keep: int, prefixes: Path):
    """(bundle, kind, reason) for every bundle past retention, before the lockfile is consulted."""
    groups: dict[tuple[str, str], list[Bundle]] = defaultdict(list)
    for b in bundles:
        if b.prefix not in defined and not _looks_whole(b):  # a user's folder, or a copy cut short
            yield b, LEFT, "no definition, and not a whole bundle of it: left for you to look at"
        elif b.prefix not in defined:
            yield b, "no-definition", f"no definition {b.prefix}.toml in {prefixes}/"
        else:
            groups[(b.prefix, b.model_folder)].append(b)
    for (prefix, folder), group in sorted(groups.items()):
        # a version counts only when it looks whole: a copy cut short, or one still arriving,
        # never costs the versions before it (nor is it deleted: it is newer)
        whole = sorted({b.version for b in group if _looks_whole(b)}, reverse=True)[:keep]
        for b in sorted(group, key=lambda b: b.version):
            if whole and b.version < min(whole):
                kept = ", ".join(map(str, whole))
                why = f"older than the newest {keep} version(s) of {prefix} for {folder} (kept: {kept})"
                yield b, "older-version", why


def _looks_whole(b: Bundle) -> bool:
    """Whether a bundle folder looks whole from its small files and sizes (no hashing): its
    files all there, its manifest matching SHA256SUMS and naming this prefix and version, its
    cache file the size the manifest records."""
    try:
        check_folder(b.path)
        m = read_manifest(b.path, read_sums(b.path).get(MANIFEST_FILE))
        size = os.lstat(b.path / CACHE_FILE).st_size
    except (BundleError, OSError):
        return False
    named = m.prefix is not None and (m.prefix.name, m.prefix.version) == (b.prefix, b.version)
    return named and size == m.cache.file_bytes


def layout_bundles(root: Path) -> list[Bundle]:
    """Real folders at <root>/<prefix name>/<version>/<slug>-<fingerprint12>, each part as the
    layout spells it; anything else (links, .staging, a user's own folder) is not a bundle."""
    found = []
    for name in _subfolders(root):
        if not is_name(name.name):
            continue
        for version in _subfolders(name):
            if (number := parse_version(version.name)) is not None:
                for model in _subfolders(version):
                    if is_model_folder(model.name):
                        found.append(Bundle(model, name.name, number, model.name))
    return found


def _subfolders(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if not p.is_symlink() and p.is_dir())


def delete(candidate: Candidate, bundles_root: Path) -> None:
    """Delete one planned folder; OSError or PipelineError (one line) when it cannot. Every step
    walks from the root without following links (format.safe_tree): a folder swapped for a link
    since the plan is refused."""
    from filelock import Timeout

    root = Path(bundles_root)
    if candidate.kind == "staging":
        if is_abandoned(candidate.path):  # its process could not have come back, but check
            remove_tree(root, candidate.path)
        return
    trash = staging_root(root) / f"{os.getpid()}-prune-{secrets.token_hex(4)}"
    make_folders(root, trash.parent)
    try:
        with target_lock(root, candidate.path):
            if is_link_or_missing(root, candidate.path):
                raise PipelineError(f"{candidate.path} is a symlink; prune never deletes links")
            rename(root, candidate.path, trash)  # the bundle path is gone at once, never half there
    except Timeout:
        raise PipelineError(
            f"{candidate.path}: a build is writing it right now; run prune again when it is done"
        ) from None
    remove_tree(root, trash)  # if this fails, the next build or prune removes it (process gone)
    for parent in (candidate.path.parent, candidate.path.parent.parent):
        if not remove_empty(root, parent):  # only when empty: the version, then the prefix
            break
