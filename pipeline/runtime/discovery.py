"""Where bundles are found: exactly <root>/<name>/<version>/<model folder>, and nothing else.

Discovery reads real folders only, at exactly that depth, with names the format defines (a prefix
name, a version in ASCII digits, <slug>-<fingerprint12>). Anything else under the root (a nested
copy such as backup/shop/1/..., a symlink, a misnamed folder) is reported, never mounted, so the
newest-only and lockfile rules see every bundle that can be mounted. `mount`, `verify --model`,
`match`, `list` and `serve` all call find_bundles.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.format.bundle_folder import ALLOWED_FILES, FINGERPRINT_CHARS, STAGING_DIR
from pipeline.format.errors import BundleError, path_argument
from pipeline.format.names import NAME_HINT, is_model_folder, is_name, parse_version
from pipeline.format.regular_files import kind_of

LAYOUT = "<bundles>/<name>/<version>/<model folder>"


@dataclass(frozen=True)
class RefusedBundle:
    """Why a bundle (or something found where bundles are looked for) was not mounted."""

    path: Path
    field: str | None
    reason: str


def _name_problem(name: str) -> str | None:
    return None if is_name(name) else f"{name!r} is not a prefix name ({NAME_HINT})"


def _version_problem(name: str) -> str | None:
    if parse_version(name) is not None:
        return None
    return f"{name!r} is not a version folder (ASCII digits without a leading zero, e.g. 2)"


def _model_problem(name: str) -> str | None:
    if is_model_folder(name):
        return None
    return f"{name!r} is not a model folder (<slug>-<first 12 hex digits of the model fingerprint>)"


LEVELS: tuple[Callable[[str], str | None], ...] = (_name_problem, _version_problem, _model_problem)


def _outside(path: Path, root: Path, what: str) -> RefusedBundle:
    return RefusedBundle(
        path,
        "layout",
        f"{what}; outside the layout {LAYOUT}, never mounted: move it out of {root}",
    )


def _entry_problem(entry: os.DirEntry, root: Path, depth: int) -> RefusedBundle | None:
    """Why an entry at this depth (0: name, 1: version, 2: model folder) is not in the layout."""
    path = Path(entry.path)
    if entry.is_symlink():
        if not path.exists():
            return RefusedBundle(path, "layout", "broken symlink; not followed")
        return _outside(path, root, f"a symlink to {path.resolve()} (links are not followed)")
    if not entry.is_dir(follow_symlinks=False):  # the directory entry's type: no stat call
        mode = entry.stat(follow_symlinks=False).st_mode
        return _outside(path, root, "a file" if stat.S_ISREG(mode) else kind_of(mode))
    problem = LEVELS[depth](entry.name)
    return None if problem is None else _outside(path, root, problem)


def _children(folder: Path, root: Path, depth: int, problems: list[RefusedBundle]) -> list[Path]:
    """The layout folders in folder at this depth; everything else goes to problems."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError as exc:
        problems.append(RefusedBundle(folder, "layout", f"cannot list it ({exc.strerror})"))
        return []
    found = []
    for entry in entries:
        if depth == 0 and entry.name == STAGING_DIR:
            continue  # the builders' own work area, part of the layout
        if depth == 0 and entry.is_file(follow_symlinks=False):
            continue  # a README beside the bundles: never a bundle, not worth a warning
        problem = _entry_problem(entry, root, depth)
        if problem is None:
            found.append(Path(entry.path))
        else:
            problems.append(problem)
    return found


def is_bundle_folder(path: Path) -> bool:
    """Any bundle file name present, whatever it is: the validator decides what it is worth."""
    return any(os.path.lexists(path / name) for name in ALLOWED_FILES)


def find_bundles(root: Path) -> tuple[list[Path], list[RefusedBundle]]:
    """Bundle folders at exactly <root>/<name>/<version>/<model folder> (or root itself when it is
    one), and everything else found under root that is not in that layout (never mounted).

    BundleError when root is not a folder.
    """
    root = path_argument(root, "find_bundles: root")
    if not root.is_dir():
        what = "is not a folder" if os.path.lexists(root) else "does not exist"
        raise BundleError(
            str(root), f"bundles folder {what}; pass the folder the bundles were copied to"
        )
    if is_bundle_folder(root):
        return [root], []
    found: list[Path] = []
    problems: list[RefusedBundle] = []
    for name in _children(root, root, 0, problems):
        for version in _children(name, root, 1, problems):
            found += _children(version, root, 2, problems)
    return sorted(found), problems


def version_key(root: Path, bundle: Path) -> tuple[tuple[str, str], int] | None:
    """((prefix name, model folder), version) for <root>/<name>/<version>/<model>, else None."""
    try:
        parts = Path(bundle).relative_to(root).parts
    except ValueError:
        return None
    if len(parts) != 3 or (version := parse_version(parts[1])) is None:
        return None
    return (parts[0], parts[2]), version


Folders = Mapping[str, Collection[str]]  # prefix name -> the model folders a lockfile names


@dataclass
class Choice:
    """What the version and lockfile rules make of candidate bundle folders."""

    chosen: list[Path] = field(default_factory=list)
    older: list[Path] = field(default_factory=list)  # another version is chosen
    unlocked: list[Path] = field(default_factory=list)  # a prefix the lockfile does not name
    refused: dict[Path, str] = field(default_factory=dict)  # path -> why (shadowing folders)


def choose(
    keys: dict[Path, tuple[str, str, int]],
    versions: dict[str, int] | None,
    folders: Folders | None = None,
) -> Choice:
    """The rules over {path: (name, model folder, version)}: per prefix and model (the folder's
    fingerprint part) the highest version, or the one `versions` (a lockfile) pins; with a
    lockfile, a prefix it does not name is unlocked. At that version one folder is chosen: the
    one `folders` (the lockfile) names, else the only one; two that could shadow each other (one
    NAME@VERSION, one model: a relabeled copy) are both refused."""
    choice, groups = Choice(), {}
    for path, (name, folder, _) in keys.items():
        if versions is not None and name not in versions:
            choice.unlocked.append(path)
        else:
            groups.setdefault((name, folder[-FINGERPRINT_CHARS:]), []).append(path)
    for (name, fp), paths in groups.items():
        top = (versions or {}).get(name) or max(keys[p][2] for p in paths)
        here = [p for p in paths if keys[p][2] == top]
        choice.older += [p for p in paths if keys[p][2] != top]
        # the folders the lockfile names for this model (none: it pins the version alone)
        named = [f for f in (folders or {}).get(name, ()) if f[-FINGERPRINT_CHARS:] == fp]
        _one_folder(choice, here, keys, named or None)
    return choice


def _one_folder(
    choice: Choice, here: list[Path], keys: dict, named: Collection[str] | None
) -> None:
    """Choose among the folders of one NAME@VERSION and model: the lockfile's, else the only one."""
    if not here:
        return
    name, _, version = keys[here[0]]
    if named is not None:
        pinned = [p for p in here if keys[p][1] in named]
        for p in here:
            if p not in pinned:
                choice.refused[p] = (
                    f"the lockfile pins {name}@{version} for this model in "
                    f"{' or '.join(sorted(named))}, not in {keys[p][1]}; not mounted "
                    "(it would shadow the pinned one): remove it, or lock what is deployed"
                )
        here = pinned
    if len(here) == 1:
        choice.chosen += here
        return
    both = " and ".join(str(p) for p in sorted(here))
    for p in here:
        choice.refused[p] = (
            f"{name}@{version} is in {len(here)} folders for one model ({both}); none is "
            "mounted (one would shadow the other): remove the one not deployed, or serve with "
            "--lockfile naming one"
        )


def choose_versions(
    root: Path,
    paths: list[Path],
    versions: dict[str, int] | None = None,
    folders: Folders | None = None,
) -> tuple[list[Path], list[Path]]:
    """(to mount, not mounted) of find_bundles' paths: per prefix and model the highest version, or
    the one `versions` pins (a prefix it does not name is not mounted), in the one folder
    `folders` names or the only one. A path outside the layout (root itself being a bundle) is
    kept: the caller judges it by its manifest."""
    keys, loose = {}, []
    for path in paths:
        if (key := version_key(root, path)) is None:
            loose.append(path)
        else:
            keys[path] = (key[0][0], key[0][1], key[1])
    c = choose(keys, versions, folders)
    return sorted(loose + c.chosen), sorted(c.older + c.unlocked + list(c.refused))
