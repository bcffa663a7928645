"""What a pull takes from a repository (a hub repo or an OCI registry): the bundle folders it
lists, those for the local model (per prefix the highest version, the ones asked for, or exactly
what a lockfile names), and the one-line errors when that is nothing or less than asked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.format.bundle_folder import FINGERPRINT_CHARS
from pipeline.format.errors import PipelineError
from pipeline.format.names import NAME_HINT, parse_ref
from pipeline.format.served_identity import identity_for


@dataclass(frozen=True)
class RemoteBundle:
    """A bundle folder a repository lists: <name>/<version>/<slug>-<fingerprint[:12]>/ (a hub
    repo's folder, or the bundle an OCI tag names)."""

    name: str
    version: int
    folder: str
    files: tuple[str, ...]

    @property
    def path(self) -> str:
        return f"{self.name}/{self.version}/{self.folder}"

    @property
    def fingerprint(self) -> str:
        """The model fingerprint prefix the folder names."""
        return self.folder[-FINGERPRINT_CHARS:]


@dataclass(frozen=True)
class Skipped:
    name: str
    version: int
    repo_path: str
    reason: str
    path: Path | None = None  # where it would have been published (a valid bundle held back)
    tokens: int | None = None  # set once validated


def parse_wanted(prefixes: list[str] | None) -> dict[str, int | None] | None:
    """--prefix NAME or NAME@VERSION -> {name: version or None (highest)}."""
    if not prefixes:
        return None
    wanted: dict[str, int | None] = {}
    for item in prefixes:
        ref = parse_ref(item)
        if ref is None:
            raise PipelineError(
                f"--prefix {item!r}: pass NAME or NAME@VERSION (e.g. shop@2; the name {NAME_HINT}, "
                "the version ASCII digits)"
            )
        wanted[ref[0]] = ref[1]
    return wanted


def locked_selection(lockfile: Path, model_dir: Path) -> dict[str, str | None]:
    """What a lockfile pins for this model: {repo path <name>/<version>/<model folder>: the
    artifact digest `push --lockfile` recorded, or None (fetched by tag)}; exactly the folders
    it names, never a sibling folder of the same version and fingerprint."""
    from pipeline.format.lockfile import given_lock

    lock = given_lock(Path(lockfile))
    fingerprint = identity_for(Path(model_dir)).model
    locked: dict[str, str | None] = {}
    for name, entry in sorted(lock.prefixes.items()):
        for folder, fp in sorted(entry.models.items()):
            if fp == fingerprint:
                locked[f"{name}/{entry.version}/{folder}"] = (entry.artifacts or {}).get(folder)
    if not locked:
        raise PipelineError(
            f"{lockfile}: no prefix is locked for the model {model_dir} (fingerprint "
            f"{fingerprint[:FINGERPRINT_CHARS]}); build for it and commit the lockfile, or pull "
            "without --lockfile"
        )
    return locked


def near_model(model_dir: Path) -> Path:
    """<model>/prefix-bundles (pipeline.runtime, imported only here: numpy and the serving path
    cost a pull ~0.15 s that names its --bundles)."""
    from pipeline.runtime.mount import model_bundles_dir

    return model_bundles_dir(Path(model_dir))


def select(
    remote: list[RemoteBundle],
    fingerprint: str,
    wanted: dict[str, int | None] | None,
    locked: Mapping[str, str | None] | None = None,
) -> tuple[list[RemoteBundle], list[Skipped]]:
    """(to pull, skipped with why): this model's folders, per prefix the highest or asked version;
    with `locked` (a lockfile's repo paths) exactly the folders it names."""
    fp = fingerprint[:FINGERPRINT_CHARS]
    mine = [b for b in remote if b.fingerprint == fp]
    skipped = [
        Skipped(b.name, b.version, b.path, f"for another model ({b.fingerprint})")
        for b in remote
        if b not in mine
    ]
    if locked is not None:
        chosen = [b for b in mine if b.path in locked]
        why = "not named by the lockfile (it pins exactly the folders it names)"
        return chosen, skipped + [
            Skipped(b.name, b.version, b.path, why) for b in mine if b not in chosen
        ]
    best: dict[str, int] = {}
    for b in mine:
        if wanted is None or (b.name in wanted and wanted[b.name] in (None, b.version)):
            best[b.name] = max(best.get(b.name, 0), b.version)
    chosen = [b for b in mine if best.get(b.name) == b.version]
    for b in mine:
        if b not in chosen:
            highest = wanted is None or (b.name in wanted and wanted[b.name] is None)
            why = "older version" if highest else "not asked for"
            skipped.append(Skipped(b.name, b.version, b.path, why))
    return chosen, skipped


def check_found(
    result: Any,  # publish.PullResult (it imports this module)
    chosen: list[RemoteBundle],
    wanted: dict[str, int | None] | None,
    fp: str,
    locked: Mapping[str, str | None] | None = None,
) -> None:
    """Pulling nothing, or less than a lockfile names, is an error: say what the repo has and how
    to get a bundle for this model."""
    where = result.source if result.commit is None else f"hub repo {result.repo}@{result.revision}"
    absent = sorted(set(locked or {}) - {b.path for b in chosen})
    if absent:
        raise PipelineError(
            f"{where}: no bundle {absent[0]}, which the lockfile pins for this model (fingerprint "
            f"{fp}); push it ('prefix-bundles push ... --lockfile'), or pull with the lockfile of "
            "what was pushed: nothing was published"
        )
    missing = sorted(set(wanted or {}) - {b.name for b in chosen})
    if missing:
        asked = ", ".join(f"{n}@{wanted[n]}" if wanted[n] else n for n in missing)
        raise PipelineError(
            f"{where}: no bundle of {asked} for this model (fingerprint {fp}); build and push it "
            f"('prefix-bundles build --model {result.model}', then push)"
        )
    if not chosen:
        raise PipelineError(
            f"{where}: no bundle for this model (fingerprint {fp}) among {len(result.skipped)} "
            f"bundle(s); build and push them ('prefix-bundles build --model {result.model}', "
            "then push)"
        )
