"""`verify`: the full validator for deploy scripts, every byte hashed."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.common import add_json_option, emit_json, err, note, read_template, say
from pipeline.cli.keys import add_trusted_key_option, trusted_keys
from pipeline.cli.reports import Refusal, VerifiedBundle, VerifyReport, VerifyTotals, refusal_of
from pipeline.format.errors import PipelineError


def add_parser(sub: argparse._SubParsersAction, parents: list) -> None:
    v = sub.add_parser(
        "verify",
        parents=parents,
        help="verify bundles against a model folder (exit 0 ok, 1 refused)",
    )
    v.add_argument(
        "bundle",
        nargs="*",
        type=Path,
        action="distinct",
        help="bundle folders, each once (default: every bundle in --bundles, or in <model>/prefix-bundles)",
    )
    v.add_argument("--model", type=Path, required=True, help="the model folder they are for")
    v.add_argument(
        "--chat-template",
        type=Path,
        help="template file the server will use instead of the model's",
    )
    add_json_option(v, "verify")
    add_trusted_key_option(v)
    v.set_defaults(func=run, bundles_near_model="read")  # --bundles: default <model>/prefix-bundles


def run(args: argparse.Namespace) -> int:
    template = read_template(args.chat_template)
    identity = _served_identity(args.model, template)
    keys = trusted_keys(args)
    results = []
    bundles = [b for given in args.bundle for b in _bundles_given(given)]
    for bundle in bundles or _in_folder(args.model, args.bundles, results):
        r = _verify_one(bundle, identity, keys)
        if r.status == "ok" and not args.json:
            say(f"ok {bundle} ({r.prefix}@{r.version}, {r.tokens} tokens)")
        results.append(r)
    ok = sum(r.status == "ok" for r in results)
    if args.json:
        emit_json(
            VerifyReport(
                model=str(args.model),
                chat_template=str(args.chat_template) if args.chat_template else None,
                bundles=results,
                totals=VerifyTotals(ok=ok, refused=len(results) - ok),
            )
        )
    return 0 if ok == len(results) else 1


def _bundles_given(path: Path) -> list[Path]:
    """A bundle argument as the bundle folders it names: itself, or, for a folder of bundles
    (a bundles folder, one prefix's or one version's: folders only, no manifest.json), every
    bundle folder under it (the validator's advice to remove '1' was advice to delete one)."""
    import os

    from pipeline.format.bundle_folder import MANIFEST_FILE, SUMS_FILE

    if path.is_symlink() or not path.is_dir():
        return [path]
    entries = list(os.scandir(path))
    if any(
        e.name in (MANIFEST_FILE, SUMS_FILE) or not e.is_dir(follow_symlinks=False) for e in entries
    ):
        return [path]  # a bundle, whole or not: the validator says what is wrong with it
    found = []
    for folder, subfolders, files in os.walk(path):  # links are not followed
        depth = len(Path(folder).relative_to(path).parts)
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))  # staging
        if MANIFEST_FILE in files or SUMS_FILE in files:
            found.append(Path(folder))
            subfolders.clear()
        elif depth >= 3:
            subfolders.clear()
    if not found:
        raise PipelineError(
            f"{path}: not a bundle folder (no {MANIFEST_FILE}) and no bundle under it; pass "
            "bundle folders (bundles/NAME/VERSION/MODEL-FINGERPRINT) or --bundles DIR"
        )
    note(f"{path}: a folder of bundles; verifying the {len(found)} bundle(s) under it")
    return sorted(found)


def _served_identity(model: Path, template: str | None):
    """The served model's identity, computed once for every bundle (or the error each reports)."""
    from pipeline.runtime import identity_for

    try:
        return identity_for(model, template)
    except PipelineError as exc:
        return exc


def _verify_one(bundle: Path, identity, keys: tuple = ()) -> VerifiedBundle:
    """Validate one bundle in full; a refusal is also the one `error:` line on stderr."""
    from pipeline.format.validate import validate

    try:
        if isinstance(identity, PipelineError):
            raise identity
        m = validate(bundle, identity, trusted_keys=keys).manifest
    except PipelineError as exc:
        err(str(exc))
        return VerifiedBundle(path=str(bundle), status="refused", refusal=refusal_of(exc))
    return VerifiedBundle(
        path=str(bundle),
        status="ok",
        prefix=m.prefix.name,
        version=m.prefix.version,
        tokens=m.tokens.count,
    )


def _in_folder(model: Path, bundles: Path | None, results: list[VerifiedBundle]) -> list[Path]:
    """No bundle arguments: every bundle in --bundles (default <model>/prefix-bundles), newest
    and older versions.

    stderr says which are the newest (what serve mounts); a symlink serve would not follow is
    refused in results. None found is an error.
    """
    import sys

    from pipeline.format.fingerprint import check_model_folder
    from pipeline.runtime import find_bundles, model_bundles_dir
    from pipeline.runtime.mount import choose_versions

    check_model_folder(model)  # named first: the bundles folder inside it is missing too
    folder = bundles or model_bundles_dir(model)
    fix = f"pass bundle folders, or copy bundles there (prefix-bundles pull --model {model} ...)"
    if not folder.is_dir():
        raise PipelineError(f"no bundle arguments and no {folder}; {fix}")
    paths, problems = find_bundles(folder)
    newest, older = choose_versions(folder, paths)
    for problem in problems:
        err(f"bundle {problem.path}: {problem.reason}")
        refusal = Refusal(field=None, check=None, reason=problem.reason)
        results.append(VerifiedBundle(path=str(problem.path), status="refused", refusal=refusal))
    if not (newest or older or problems):
        raise PipelineError(f"no bundle in {folder}; {fix}")
    for path in sorted(newest + older):
        say(f"{'newest' if path in newest else 'older '} {path}", file=sys.stderr)
    return sorted(newest + older)
