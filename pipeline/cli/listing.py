"""`list`: every definition and its bundles for the current version."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.format.errors import PipelineError


def add_parser(sub: argparse._SubParsersAction, parents: list) -> None:
    sub.add_parser(
        "list", parents=parents, help="definitions and their bundles: built, missing or broken"
    ).set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.build.definition import find_definitions, load_definition
    from pipeline.format.bundle_files import read_manifest
    from pipeline.format.errors import BundleError
    from pipeline.runtime.validate import recorded_identity, validate

    broken = 0
    root = Path(args.prefixes).resolve().parent
    for path in find_definitions(args.prefixes):
        try:
            definition = load_definition(path, root)
        except PipelineError as exc:
            print(f"{path.stem}  broken definition: {exc}")
            broken += 1
            continue
        folder = Path(args.bundles) / definition.name / str(definition.version)
        bundles = sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
        if not bundles:
            print(f"{definition.name}@{definition.version}  missing  {folder}")
        for bundle in bundles:
            try:
                manifest = validate(bundle, recorded_identity(read_manifest(bundle, None))).manifest
                state = f"built ({manifest.tokens.count} tokens)"
            except BundleError as exc:
                state, broken = f"broken: {exc.reason}", broken + 1
            print(f"{definition.name}@{definition.version}  {bundle.name:<36} {state}  {bundle}")
    return 1 if broken else 0
