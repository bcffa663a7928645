"""`build`: definitions -> bundles, the lockfile written (or, with --locked, checked)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.cli.common import load_definitions, progress


def add_parser(sub: argparse._SubParsersAction, parents: list) -> None:
    b = sub.add_parser("build", parents=parents, help="build bundles for prefix definitions")
    b.add_argument("prefix", nargs="*", help="definition names (default: all)")
    b.add_argument(
        "--model", type=Path, help="build for this model folder instead of the definition's models"
    )
    b.add_argument(
        "--force", action="store_true", help="rebuild even when the bundle is up to date"
    )
    b.add_argument(
        "--locked",
        action="store_true",
        help="CI: refuse any definition or model that differs from prefixes.lock; never write it",
    )
    b.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="warm-equals-cold fidelity check before shipping (default: on)",
    )
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline import BLAS_STATUS
    from pipeline.build.builder import build
    from pipeline.build.targets import targets
    from pipeline.build.versioning import check_locked, locked_entry
    from pipeline.build.writer import clean_staging
    from pipeline.format.fingerprint import model_fingerprint
    from pipeline.format.layout import model_folder
    from pipeline.format.lockfile import lock_path, read_lock, write_lock

    definitions = load_definitions(args.prefixes, args.prefix)
    lock_file = lock_path(args.prefixes)
    lock = read_lock(lock_file)
    print(BLAS_STATUS.notice, file=sys.stderr)
    clean_staging(args.bundles)
    for definition in definitions:
        plan = targets(definition, args.prefixes.resolve().parent, args.model)
        if args.locked:  # before any prefill: CI builds only what prefixes.lock names
            planned = [(t.slug, model_fingerprint(t.model_dir)) for t in plan]
            check_locked(definition, lock, {model_folder(sl, fp): fp for sl, fp in planned})
        built: dict[str, str] = {}
        for target in plan:
            label = f"{definition.name}@{definition.version} -> {target.slug}"
            result = build(
                target,
                args.bundles,
                force=args.force,
                check=args.check,
                progress=progress(label),
                lock=lock,
            )
            m = result.manifest
            built[model_folder(m.model.slug, m.model.fingerprint)] = m.model.fingerprint
            _print_built(label, result)
        if not args.locked:
            entries = {**lock.prefixes, definition.name: locked_entry(definition, lock, built)}
            lock = lock.model_copy(update={"prefixes": entries})
            write_lock(lock_file, lock)  # after each definition: a later failure keeps this one
    return 0


def _print_built(label: str, result) -> None:
    m = result.manifest
    if result.up_to_date:
        print(f"{label}: up to date ({result.bundle})")
        return
    r, fid = result.report, m.fidelity
    check = (
        f", fidelity max|dlogit| {fid.max_abs_logit_diff:.3g} greedy_match {fid.greedy_match}"
        if fid.checked
        else ""
    )
    print(
        f"{label}: {m.tokens.count} tokens (stable {m.tokens.stable_tokens}/{m.tokens.rendered_tokens}), "
        f"{r['prefill_seconds']:.2f}s ({r['tokens_per_second']:,.0f} tok/s), "
        f"peak {r['peak_memory_bytes'] / 2**20:,.0f} MiB{check} -> {result.bundle}"
    )
