"""Command line: argparse, printing and exit codes. The only module that talks to the terminal."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pipeline.format.errors import PipelineError

DEMO_MODEL = Path("models/demo-tiny")


def _err(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


def _progress(label: str):
    """Prefill progress on stderr: the size first, an ETA after the first chunk, then every 0.5 s."""
    tty = sys.stderr.isatty()
    last: list[float | None] = [None]  # when the last rate line was printed

    def report(done: int, total: int, elapsed: float) -> None:
        now = time.perf_counter()
        if done == 0:  # no rate yet, so no ETA: just the size
            line = f"{label}: prefill {total} tokens"
        elif done < total and last[0] is not None and now - last[0] < 0.5:
            return
        else:
            rate = done / max(elapsed, 1e-9)
            eta = (total - done) / max(rate, 1e-9)
            line = f"{label}: prefill {done}/{total} tokens, {rate:,.0f} tok/s, ETA {eta:.1f}s"
        last[0] = now if done else None
        print(
            ("\r" + line) if tty else line,
            end="" if tty and done < total else "\n",
            file=sys.stderr,
        )

    return report


def _load_definitions(prefix_dir: Path, names: list[str]):
    from pipeline.build.definition import find_definitions, load_definition

    paths = find_definitions(prefix_dir)
    if names:
        by_name = {p.stem: p for p in paths}
        missing = [n for n in names if n not in by_name]
        if missing:
            raise PipelineError(
                f"no definition named {', '.join(missing)} in {prefix_dir}/ "
                f"(have: {', '.join(sorted(by_name)) or 'none'})"
            )
        paths = [by_name[n] for n in names]
    if not paths:
        raise PipelineError(f"no prefix definitions (*.toml) in {prefix_dir}/")
    root = Path(prefix_dir).resolve().parent
    return [load_definition(p, root) for p in paths]


def cmd_build(args: argparse.Namespace) -> int:
    from pipeline import BLAS_STATUS
    from pipeline.build.builder import build
    from pipeline.build.targets import targets
    from pipeline.build.versioning import check_locked, locked_entry
    from pipeline.build.writer import clean_staging
    from pipeline.format.fingerprint import model_fingerprint
    from pipeline.format.layout import model_folder
    from pipeline.format.lockfile import lock_path, read_lock, write_lock

    definitions = _load_definitions(args.prefixes, args.prefix)
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
                progress=_progress(label),
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


def cmd_verify(args: argparse.Namespace) -> int:
    from pipeline.runtime import verify

    template = _read_template(args.chat_template)
    failed = 0
    for bundle in args.bundle:
        try:
            m = verify(bundle, args.model, template)
            print(f"ok {bundle} ({m.prefix.name}@{m.prefix.version}, {m.tokens.count} tokens)")
        except PipelineError as exc:
            _err(str(exc))
            failed += 1
    return 1 if failed else 0


def _read_template(path: Path | None) -> str | None:
    if path is None:
        return None
    from pipeline.format.files import FileProblem, read_text

    try:
        return read_text(Path(path), 16 << 20)
    except FileProblem as exc:
        raise PipelineError(f"--chat-template {path}: {exc}; pass a template file") from None


def cmd_inspect(args: argparse.Namespace) -> int:
    from pipeline.format.bundle_files import read_manifest

    bundle = Path(args.bundle)
    manifest = read_manifest(bundle, None)  # shown even when invalid; validity is decided below
    refusal = _validity(bundle, manifest, args)
    if args.json:
        data = manifest.model_dump(mode="json")
        data["validity"] = {
            "valid": refusal is None,
            "for_model": str(args.model) if args.model else None,
            "refusal": None
            if refusal is None
            else {"field": refusal.field, "reason": refusal.reason},
        }
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0 if refusal is None else 1
    _print_manifest(bundle, manifest.model_dump(mode="json"))
    sizes = {p.name: p.stat().st_size for p in sorted(bundle.iterdir()) if p.is_file()}
    print("  files: " + ", ".join(f"{k} {v:,} B" for k, v in sizes.items()))
    _print_checks(manifest, args, refusal)
    return 0 if refusal is None else 1


def _validity(bundle: Path, manifest, args: argparse.Namespace):
    """The validator's verdict: None when valid, else the BundleError (for the model, if given)."""
    from pipeline.format.errors import BundleError
    from pipeline.runtime.mount import identity_for
    from pipeline.runtime.validate import recorded_identity, validate

    identity = (
        identity_for(args.model, _read_template(args.chat_template))
        if args.model
        else recorded_identity(manifest)
    )
    try:
        validate(bundle, identity)
    except BundleError as exc:
        return exc
    return None


def _print_checks(manifest, args: argparse.Namespace, refusal) -> None:
    """The validator's stages in order: ok up to the one that refused, which says why."""
    from pipeline.runtime.identity import identity_checks
    from pipeline.runtime.mount import identity_for
    from pipeline.runtime.validate import CHECKS

    target = (
        f" for model {args.model}"
        if args.model
        else " (integrity only; pass --model DIR to check fingerprints)"
    )
    print(f"checks{target}:")
    failed = refusal.check if refusal is not None else None
    reached = True
    for name, detail in CHECKS:
        if name == "identity" and args.model and reached:
            identity = identity_for(args.model, _read_template(args.chat_template))
            for c in identity_checks(manifest, identity):
                line = f"{(c.found or 'none')[:16]}.. matches" if c.ok else c.error(Path("")).reason
                print(f"  {'ok  ' if c.ok else 'FAIL'} {c.what:<21} {line}")
        elif name == failed:
            print(f"  FAIL {name:<21} {refusal.reason}")
        elif reached:
            print(f"  ok   {name:<21} {detail}")
        else:
            print(f"  --   {name:<21} not reached")
        reached = reached and name != failed
    t, f = manifest.tokens, manifest.fidelity
    print(
        f"  info stability              {t.stable_tokens}/{t.rendered_tokens} rendered tokens are a prefix of every probe turn"
    )
    if f.checked:
        print(
            f"  info fidelity               max |logit diff| {f.max_abs_logit_diff:.3g} <= {f.threshold:g}, greedy match {f.greedy_match} (at build)"
        )
    print(
        f"valid{' for ' + str(args.model) if args.model else ''}: {'yes' if refusal is None else 'no'}"
    )


def _print_manifest(bundle: Path, data: dict) -> None:
    print(f"bundle {bundle}")
    for section in ("prefix", "tokens", "model", "cache", "fidelity", "builder"):
        values = data[section]
        print(f"  {section}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    print(f"  text: {data['text']['chars']} chars, sha256 {data['text']['sha256'][:16]}..")
    print("  preview: " + json.dumps(data["text"]["preview"], ensure_ascii=False))
    print(f"  build_key: {data['build_key']}")


def cmd_list(args: argparse.Namespace) -> int:
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


def cmd_demo_model(args: argparse.Namespace) -> int:
    from pipeline.testmodels.model import generate_model

    print(generate_model(args.out, args.size, seed=args.seed))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from pipeline.build.demo import run_demo

    rows = run_demo(args.prefixes, args.bundles, DEMO_MODEL, progress=_progress)
    header = f"{'prefix':<22}{'tokens':>8}{'bytes':>13}{'prefill s':>11}{'mount ms':>10}  status"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['prefix']:<22}{r['tokens']:>8}{r['bytes']:>13,}{r['prefill_s']:>11.3f}"
            f"{r['mount_ms']:>10.1f}  {r['status']}, verified, mounted"
        )
    return 0


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="build.py", description="Build, verify and serve MLX prefix-cache bundles."
    )
    p.add_argument(
        "--prefixes",
        type=Path,
        default=Path("prefixes"),
        help="definitions folder (default: prefixes)",
    )
    p.add_argument(
        "--bundles", type=Path, default=Path("bundles"), help="bundles folder (default: bundles)"
    )
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="build bundles for prefix definitions")
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
    b.set_defaults(func=cmd_build)

    v = sub.add_parser(
        "verify", help="verify bundles against a model folder (exit 0 ok, 1 refused)"
    )
    v.add_argument("bundle", nargs="+", type=Path)
    v.add_argument("--model", type=Path, required=True)
    v.add_argument(
        "--chat-template",
        type=Path,
        help="template file the server will use instead of the model's",
    )
    v.set_defaults(func=cmd_verify)

    i = sub.add_parser("inspect", help="show what a bundle holds and whether it is valid")
    i.add_argument("bundle", type=Path)
    i.add_argument("--model", type=Path, help="also check validity for this model folder")
    i.add_argument("--chat-template", type=Path)
    i.add_argument("--json", action="store_true", help="print the manifest and validity as JSON")
    i.set_defaults(func=cmd_inspect)

    sub.add_parser("list", help="definitions and their bundles, built or missing").set_defaults(
        func=cmd_list
    )

    m = sub.add_parser("demo-model", help="generate the deterministic demo/test model folder")
    m.add_argument("--size", choices=("tiny", "bench"), default="tiny")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--out", type=Path, default=DEMO_MODEL)
    m.set_defaults(func=cmd_demo_model)

    sub.add_parser(
        "demo", help="generate the demo model, build, verify and mount every example"
    ).set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point: one-line 'error: ...' and exit 1 on failure, 2 on usage errors."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        from pipeline.runtime.serve import main as serve_main

        return serve_main(argv[1:])
    args = setup_arg_parser().parse_args(argv)
    try:
        return args.func(args)
    except PipelineError as exc:
        _err(str(exc))
        return 1
    except OSError as exc:  # a last line of defence: every OS error is one line, never a traceback
        _err(f"{exc.filename or 'I/O'}: {exc.strerror or exc}")
        return 1
    except KeyboardInterrupt:
        _err("interrupted; no partial bundle was left in place")
        return 130


if __name__ == "__main__":
    sys.exit(main())
