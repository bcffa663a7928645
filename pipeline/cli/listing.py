"""`list`: every definition and its bundles for the current version."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.common import add_json_option, emit, integrity_identity, say, warn
from pipeline.cli.reports import (
    ListedBundle,
    ListedDefinition,
    ListReport,
    ListTotals,
    Refusal,
    refusal_of,
)
from pipeline.format.errors import PipelineError


def add_parser(sub: argparse._SubParsersAction, parents: list) -> None:
    p = sub.add_parser(
        "list", parents=parents, help="definitions and their bundles: built, missing or broken"
    )
    add_json_option(p, "list")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.builder.definition import require_definitions

    definitions = require_definitions(args.prefixes)
    root = Path(args.prefixes).resolve().parent
    found = _discovered(Path(args.bundles))
    listed = [_definition(path, root, Path(args.bundles), found) for path in definitions]
    report = ListReport(
        prefixes=str(args.prefixes),
        bundles=str(args.bundles),
        definitions=listed,
        totals=_totals(listed),
    )
    emit(args, report, _print)
    t = report.totals
    return 1 if t.broken_definitions or t.broken else 0


def _discovered(bundles_root: Path) -> dict[tuple[str, int], list[Path]]:
    """Bundles by (name, version), found as serve finds them; what is outside the layout is
    reported on stderr (serve would not mount it)."""
    from pipeline.runtime.discovery import find_bundles, version_key

    if not bundles_root.is_dir():
        return {}
    paths, problems = find_bundles(bundles_root)
    for problem in problems:
        warn(f"bundle {problem.path}: {problem.reason}")
    found: dict[tuple[str, int], list[Path]] = {}
    for path in paths:
        if (key := version_key(bundles_root, path)) is not None:
            found.setdefault((key[0][0], key[1]), []).append(path)
    return found


def _definition(
    path: Path, root: Path, bundles_root: Path, found: dict[tuple[str, int], list[Path]]
) -> ListedDefinition:
    from pipeline.builder.definition import load_definition

    name, file = path.stem, str(path)
    try:
        definition = load_definition(path, root)
    except PipelineError as exc:
        return ListedDefinition(name=name, file=file, status="broken", error=str(exc), bundles=[])
    folder = bundles_root / definition.name / str(definition.version)
    built = [_bundle(b) for b in found.get((definition.name, definition.version), [])]
    bundles = _shadowed(definition.name, definition.version, folder, found, built)
    bundles = bundles or [ListedBundle(path=str(folder), status="missing")]
    version = definition.version
    return ListedDefinition(name=name, file=file, status="ok", version=version, bundles=bundles)


def _shadowed(
    name: str,
    version: int,
    folder: Path,
    found: dict[tuple[str, int], list[Path]],
    bundles: list[ListedBundle],
) -> list[ListedBundle]:
    """Serve mounts the highest version on disk per prefix and model folder and never falls back
    to an older one: a model folder holding a version above the definition's is broken for it."""
    higher: dict[str, tuple[int, Path]] = {}
    for (n, v), paths in sorted(found.items()):  # by version: the highest is kept
        if n == name and v > version:
            higher.update((path.name, (v, path)) for path in paths)
    listed = {b.model_folder: b for b in bundles}
    for model_folder, (v, path) in higher.items():
        reason = _shadow_reason(name, version, v, path)
        listed[model_folder] = ListedBundle(
            path=str(folder / model_folder),
            model_folder=model_folder,
            status="broken",
            refusal=Refusal(field=None, check=None, reason=reason),
        )
    return [listed[k] for k in sorted(listed)]


def _shadow_reason(name: str, version: int, higher: int, path: Path) -> str:
    """What serve does with the higher version instead, and the two ways out."""
    fix = f"remove {path}, or give the definition a version above {higher} and build it"
    verdict = _bundle(path)
    if verdict.status == "built":
        return f"serve mounts {name}@{higher} ({path}) instead of version {version}; {fix}"
    return (
        f"serve picks {name}@{higher} ({path}), the highest version on disk, and refuses it "
        f"({verdict.refusal.reason}); it never falls back to version {version}, so this model "
        f"runs {name} cold; {fix}"
    )


def _bundle(bundle: Path) -> ListedBundle:
    """Built or broken, by the validator against the identity the bundle records (integrity)."""
    from pipeline.format.errors import BundleError
    from pipeline.format.validate import validate

    path, folder = str(bundle), bundle.name
    try:
        manifest = validate(bundle, integrity_identity(bundle)).manifest
    except BundleError as exc:
        refusal = refusal_of(exc)
        return ListedBundle(path=path, model_folder=folder, status="broken", refusal=refusal)
    tokens, size = manifest.tokens.count, manifest.cache.file_bytes
    return ListedBundle(path=path, model_folder=folder, status="built", tokens=tokens, bytes=size)


def _totals(listed: list[ListedDefinition]) -> ListTotals:
    states = [b.status for d in listed for b in d.bundles]
    return ListTotals(
        definitions=len(listed),
        broken_definitions=sum(d.status == "broken" for d in listed),
        built=states.count("built"),
        missing=states.count("missing"),
        broken=states.count("broken"),
    )


def _print(report: ListReport) -> None:
    """An aligned table with a header; a missing or broken bundle says the command to run."""
    rows = []
    for d in report.definitions:
        if d.status == "broken":
            rows.append((d.name, "-", "-", "-", "broken definition", f"{d.error}"))
        for b in d.bundles:
            label = f"{d.name}@{d.version}"
            if b.status == "missing":
                rows.append(
                    (label, "-", "-", "-", "missing", f"build it: prefix-bundles build {d.name}")
                )
            elif b.status == "built":
                size = f"{b.bytes / 2**20:,.1f} MiB" if b.bytes is not None else "-"
                rows.append((label, b.model_folder, f"{b.tokens:,}", size, "built", b.path))
            else:
                fix = b.refusal.reason  # a version above the definition's names its own fix
                if b.refusal.check is not None:  # the validator refused it
                    fix += f"; rebuild: prefix-bundles build {d.name} --force"
                rows.append((label, b.model_folder, "-", "-", "broken", fix))
    header = ("prefix", "model folder", "tokens", "size", "status", "path / what to do")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(5)]
    for row in [header, *rows]:
        cells = [
            str(c).ljust(w) if i != 2 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=False))
        ]
        say("  ".join([*cells, row[5]]).rstrip())
