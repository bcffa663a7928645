"""Build every target of a set of definitions: shards, prefixes.lock, staging left by dead builds.

`prefix-bundles build` parses its options, calls `build_all` and prints each outcome.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.builder.builder import BuildResult, build
from pipeline.builder.definition import LoadedDefinition, find_definitions, load_definition
from pipeline.builder.prefill import Progress
from pipeline.builder.shards import Shard, shard_refs
from pipeline.builder.targets import Target, targets
from pipeline.builder.versioning import check_locked, locked_entry
from pipeline.builder.writer import clean_staging
from pipeline.format.bundle_folder import model_folder
from pipeline.format.errors import PipelineError
from pipeline.format.fingerprint import check_model_folder, model_fingerprint
from pipeline.format.lockfile import (
    LockError,
    Lockfile,
    LockWriteError,
    lock_path,
    read_lock,
    update_lock,
)


@dataclass(frozen=True)
class BuildPlan:
    """Where definitions and bundles live, and which targets to build."""

    prefixes: Path
    bundles: Path
    model: Path | None = None  # instead of the definitions' models
    shard: Shard | None = None
    locked: bool = False  # CI: refuse anything prefixes.lock does not name; never write it


@dataclass(frozen=True)
class Outcome:
    """One target: built, up to date, or failed (then build_all raises `error` next)."""

    definition: LoadedDefinition
    ref: str  # the model as the definition names it: models.path or repo@revision
    slug: str
    result: BuildResult | None
    error: Exception | None = None

    @property
    def label(self) -> str:
        return f"{self.definition.name}@{self.definition.version} -> {self.slug}"


def select_definitions(prefix_dir: Path, names: Sequence[str]) -> list[LoadedDefinition]:
    """The named definitions in prefix_dir, in the order named (all, sorted, when none are)."""
    loaded, failed = load_each(prefix_dir, names)
    if failed:
        raise failed[0][1]
    return loaded


def load_each(
    prefix_dir: Path, names: Sequence[str]
) -> tuple[list[LoadedDefinition], list[tuple[Path, PipelineError]]]:
    """The named definitions (all, sorted, when none are), each loaded on its own: the ones that
    load, and (file, error) for each that does not (a bad definition stops no other)."""
    paths = find_definitions(prefix_dir)
    if names:
        by_name = {p.stem: p for p in paths}
        missing = [n for n in names if n not in by_name]
        if missing:
            close = difflib.get_close_matches(missing[0], list(by_name), n=1)
            guess = f"; did you mean '{close[0]}'?" if close else ""
            raise PipelineError(
                f"no definition named {', '.join(missing)} in {prefix_dir}/ "
                f"(have: {', '.join(sorted(by_name)) or 'none'}){guess}"
            )
        paths = [by_name[n] for n in names]
    if not paths:
        raise PipelineError(f"no prefix definitions (*.toml) in {prefix_dir}/")
    root = Path(prefix_dir).resolve().parent
    loaded, failed = [], []
    for path in paths:
        try:
            loaded.append(load_definition(path, root))
        except PipelineError as exc:
            failed.append((path, exc))
    return loaded, failed


class LockNotUpdated(LockError):
    """A definition's bundles were published but its prefixes.lock entry was not written."""

    reported = True  # no target failed: each was reported as built


class BuildFailures(PipelineError):
    """Some definitions failed; the others were built (each failure was reported as it came)."""

    def __init__(self, failures: list[tuple[str, Exception]], total: int) -> None:
        names = ", ".join(name for name, _ in failures)
        others = "the others were built: " if len(failures) < total else ""
        super().__init__(
            f"{len(failures)} of {total} definition{'s' if total != 1 else ''} failed ({names}); "
            f"{others}fix the errors above and build again"
        )
        self.failures = failures


def build_all(
    definitions: Sequence[LoadedDefinition],
    plan: BuildPlan,
    report: Callable[[Outcome], None],
    progress: Callable[[str], Progress | None] = lambda label: None,
    fail_fast: bool = False,
    failed: Sequence[tuple[str, Exception]] = (),
    **options: Any,
) -> None:
    """Build each definition in order, on its own; `options` go to builder.build.

    Every target is reported, a failed one too. A failed definition stops no other: the rest are
    built (and signed) and BuildFailures names every failure at the end (`failed`: definitions
    that did not even load, already reported). `fail_fast`: the first error is raised at once.
    prefixes.lock is updated after each definition (that entry only, merged under its file
    lock), so a later failure keeps what was built and a build beside this one keeps its entries.
    """
    if plan.model is not None:  # one --model for all: a bad one is one error, not one per target
        check_model_folder(Path(plan.model))
    refs = shard_refs(list(definitions), plan.model, plan.shard)
    read_lock(lock_path(plan.prefixes))  # a malformed lockfile stops the build before any prefill
    clean_staging(plan.bundles)
    failures = list(failed)
    for definition in definitions:
        if not refs[definition.name]:  # another shard's
            continue
        try:
            _build_definition(definition, refs[definition.name], plan, report, progress, options)
        except (PipelineError, OSError) as exc:
            if not getattr(exc, "reported", False):  # before any target: model, lockfile
                ref = ", ".join(refs[definition.name])
                report(Outcome(definition, ref, "-", None, exc))
            if fail_fast:
                raise exc from None
            failures.append((definition.name, exc))
    total = len(definitions) + len(failed)
    if failures and total == 1:
        raise failures[0][1]  # one definition: its own error is the whole story
    if failures:
        raise BuildFailures(failures, total)


def _build_definition(
    definition: LoadedDefinition,
    refs: list[str],
    plan: BuildPlan,
    report: Callable[[Outcome], None],
    progress: Callable[[str], Progress | None],
    options: dict[str, Any],
) -> None:
    """Build one definition's targets against the lockfile as it is now, then record them."""
    lock = read_lock(lock_path(plan.prefixes))  # what builds beside this one locked meanwhile
    root = plan.prefixes.resolve().parent
    planned = targets(definition, root, plan.model, refs if plan.shard else None)
    if plan.locked:  # before any prefill: CI builds only what prefixes.lock names
        fingerprints = [(t.slug, model_fingerprint(t.model_dir)) for t in planned]
        check_locked(definition, lock, {model_folder(s, fp): fp for s, fp in fingerprints})
    built: dict[str, str] = {}
    for ref, target in zip(refs, planned, strict=True):
        m = _build_one(target, ref, lock, plan, report, progress, options).manifest
        built[model_folder(m.model.slug, m.model.fingerprint)] = m.model.fingerprint
    if not plan.locked:
        _record_lock(plan.prefixes, definition, built)


def _record_lock(prefixes: Path, definition: LoadedDefinition, built: dict[str, str]) -> None:
    """The definition's prefixes.lock entry, once its bundles are published: a failure here is
    the lockfile's own (LockNotUpdated), never one of the targets, all reported built."""
    label = f"{definition.name}@{definition.version}"
    try:
        update_lock(lock_path(prefixes), definition.name, locked_entry(definition, built))
    except LockWriteError as exc:
        raise LockNotUpdated(
            f"{label}: its bundles are built and published, but prefixes.lock does not record "
            f"them: {exc}; make it and its folder writable and run the build again (it finds "
            "them up to date and records them)"
        ) from None
    except LockError as exc:
        raise LockNotUpdated(
            f"{label}: its bundles are built and published, but prefixes.lock does not record "
            f"them: {exc}"
        ) from None


def _build_one(
    target: Target,
    ref: str,
    lock: Lockfile,
    plan: BuildPlan,
    report: Callable[[Outcome], None],
    progress: Callable[[str], Progress | None],
    options: dict[str, Any],
) -> BuildResult:
    outcome = Outcome(target.definition, ref, target.slug, None)
    try:
        result = build(target, plan.bundles, progress=progress(outcome.label), lock=lock, **options)
    except (PipelineError, OSError) as exc:
        report(Outcome(target.definition, ref, target.slug, None, exc))
        exc.reported = True  # type: ignore[union-attr]
        raise exc from None
    report(Outcome(target.definition, ref, target.slug, result))
    return result
