"""`build`: definitions -> bundles, the lockfile written (or, with --locked, checked)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.cli.common import (
    add_json_option,
    emit_json,
    err,
    error_text,
    progress,
    say,
    warn,
)
from pipeline.cli.reports import BuildReport, BuildTotals, BuiltTarget
from pipeline.cli.reports import Shard as ShardInfo
from pipeline.format.errors import PipelineError

SHARD_HELP = (
    "build only shard I of N (1-based), for a CI matrix: the (definition, model) pairs, keyed "
    "'<name>@<version>/<models.path or models.repo@revision>', are sorted and the k-th (0-based) "
    "goes to shard k mod N + 1; the N shards partition the pairs exactly (use with --locked)"
)


def add_parser(sub: argparse._SubParsersAction, parents: list) -> None:
    b = sub.add_parser("build", parents=parents, help="build bundles for prefix definitions")
    b.add_argument(
        "prefix", nargs="*", action="distinct", help="definition names, each once (default: all)"
    )
    b.add_argument(
        "--fail-fast",
        action="store_true",
        help="stop at the first definition that fails (default: build every other one, then "
        "exit 1 naming the failures)",
    )
    b.add_argument(
        "-v", "--verbose", action="store_true", help="also print the BLAS line when it is fast"
    )
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
    lineage = b.add_mutually_exclusive_group()  # --full never continues a parent: one of them
    lineage.add_argument(
        "--full",
        action="store_true",
        help="prefill from token 0 (the reference); by default a build continues the stored KV "
        "of the proven bundle under --bundles sharing the most tokens with it, at the exact "
        "shared token",
    )
    lineage.add_argument(
        "--parent",
        type=Path,
        metavar="BUNDLE",
        help="continue this bundle's cache, or fail saying why it cannot be continued",
    )
    b.add_argument(
        "--trusted-key",
        action="append",
        type=Path,
        default=[],
        metavar="FILE",
        help="a minisign public key (repeatable): an incremental build then starts only from a "
        "parent carrying a valid manifest.json.minisig by one of them",
    )
    b.add_argument(
        "--parent-check",
        choices=("proven", "sample", "chunks"),
        default="proven",
        help="an incremental build reuses a parent signed by a --trusted-key or built by this "
        "builder with no recompute; any other parent: proven (default) = not reused, sample = "
        "spot check two 64-token windows within float tolerance, chunks = recompute two whole "
        "chunks and compare every byte (docs/definitions.md#incremental-builds)",
    )
    b.add_argument("--shard", type=_shard, metavar="I/N", help=SHARD_HELP)
    b.add_argument(
        "--sign-key",
        type=Path,
        metavar="FILE",
        help="sign each bundle with this minisign secret key before it is published; an "
        "up-to-date bundle is signed only when its signature by this key (or a --trusted-key) "
        "verifies, or when a rebuild from token 0 gives the same bytes (else refused); "
        "PREFIX_BUNDLES_SIGNING_KEY may hold the key text instead: pass --sign-key env",
    )
    add_json_option(
        b,
        "build",
        "; per-target lines go to stderr; on an error it lists what was done and the failed target",
    )
    b.set_defaults(func=run, moot_with={"full": ("parent_check",)})  # --full continues no parent


def _parent_keys(args: argparse.Namespace) -> tuple:
    """The --trusted-key public keys a parent must be signed by (empty: none given)."""
    from pipeline.cli.keys import trusted_keys

    return trusted_keys(args)


def _signing_key(option: Path | None):
    """The --sign-key secret key (`env`: from PREFIX_BUNDLES_SIGNING_KEY), or None."""
    if option is None:
        return None
    from pipeline.cli.keys import load_secret_key

    return load_secret_key(None if str(option) == "env" else option, "--sign-key")


def _shard(text: str):
    from pipeline.builder.shards import Shard

    try:
        return Shard.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--shard ")) from None


def load_each_definition(prefix_dir: Path, names: list[str], fail_fast: bool) -> tuple[list, list]:
    """The definitions that load, and (name, error) for those that do not (each reported
    now; with fail_fast the first is raised)."""
    from pipeline.builder.batch import load_each
    from pipeline.builder.definition import stray_definitions

    for stray in stray_definitions(prefix_dir):
        warn(f"{stray}: definitions in subfolders are not loaded; move it to {prefix_dir}/")
    loaded, failed = load_each(prefix_dir, names)
    if failed and (fail_fast or len(loaded) + len(failed) == 1):
        raise failed[0][1]
    for _, exc in failed:
        err(str(exc))
    return loaded, [(path.stem, exc) for path, exc in failed]


def run(args: argparse.Namespace) -> int:
    """Build each definition on its own (a failure stops no other, unless --fail-fast); exit 1
    when any failed (with --json, still one document)."""
    from pipeline.blas import blas_status
    from pipeline.builder.batch import BuildPlan, LockNotUpdated, build_all

    done: list[BuiltTarget] = []
    try:
        definitions, broken = load_each_definition(args.prefixes, args.prefix, args.fail_fast)
        args.several = not args.fail_fast and len(definitions) + len(broken) > 1
        options = {
            "force": args.force,
            "check": args.check,
            "parent": args.parent,
            "incremental": not args.full,
            "sign_key": _signing_key(args.sign_key),  # before any prefill: a bad key fails first
            "trusted_keys": _parent_keys(args),  # a parent must be signed by one of them
            "parent_check": args.parent_check,
        }
        plan = BuildPlan(args.prefixes, args.bundles, args.model, args.shard, args.locked)
        if args.verbose:
            print(blas_status().notice, file=sys.stderr)
        elif not blas_status().active:  # slow: worth a line without -v
            warn(blas_status().notice)
        record = lambda o: done.append(_record(args, o))  # noqa: E731
        bars = _progress_bars(definitions, plan)
        build_all(definitions, plan, record, bars, args.fail_fast, broken, **options)
    except (PipelineError, OSError) as exc:
        failures = getattr(exc, "failures", None)  # every definition's error, not the summary
        for _, e in failures or []:  # no target's: no outcome printed it
            if isinstance(e, LockNotUpdated):
                err(str(e))
        if args.json:
            text = "; ".join(error_text(e) for _, e in failures) if failures else error_text(exc)
            emit_json(_report(args, done, text))
        raise  # main prints the one `error:` line and exits 1
    if args.json:
        emit_json(_report(args, done, None))
    return 0


def _progress_bars(definitions: list, plan):
    """progress(label), each target's ETA given its model's cost (pipeline.cli.eta)."""
    from pipeline.cli.eta import crossover_for_model

    folders = model_folders(definitions, plan.prefixes, plan.model)
    return lambda label: progress(label, crossover_for_model(folders.get(label)))


def model_folders(definitions: list, prefixes: Path, model: Path | None) -> dict[str, Path]:
    """Each target's local model folder by its progress label ('name@version -> slug'), read
    ahead of the build for its config.json; hub models have none here (a default cost then)."""
    from pipeline.builder.definition import model_slug, slugify

    root, folders = Path(prefixes).resolve().parent, {}
    for d in definitions:
        head = f"{d.name}@{d.version} -> "
        if model is not None:
            folders[head + slugify(Path(model).resolve().name)] = Path(model)
        for spec in [] if model is not None else d.spec.models:
            if spec.path is not None:
                folders[head + model_slug(spec)] = root / spec.path
    return folders


def _record(args: argparse.Namespace, outcome) -> BuiltTarget:
    """One target for --json; built and up-to-date ones are printed (stderr with --json)."""
    d, result = outcome.definition, outcome.result
    if result is None:
        error = error_text(outcome.error)
        if getattr(args, "several", False):  # each failure as it comes; a summary ends the run
            err(f"{outcome.label}: {error}")
        return BuiltTarget(
            prefix=d.name, version=d.version, model=outcome.ref, status="failed", error=error
        )
    _print_built(outcome.label, result, sys.stderr if args.json else sys.stdout)
    if result.advice and not result.up_to_date:
        warn(result.advice)
    if not result.up_to_date and result.report.get("parent_warning"):
        warn(result.report["parent_warning"])  # a parent failed its spot check
    m, r = result.manifest, result.report
    return BuiltTarget(
        prefix=d.name,
        version=d.version,
        model=outcome.ref,
        status="up-to-date" if result.up_to_date else "built",
        path=str(result.bundle),
        tokens=m.tokens.count,
        bytes=m.cache.file_bytes,
        prefill_seconds=r.get("prefill_seconds"),
        tokens_per_second=r.get("tokens_per_second"),
        reused_tokens=r.get("reused_tokens"),
    )


def _report(args: argparse.Namespace, done: list[BuiltTarget], error: str | None) -> BuildReport:
    states = [t.status for t in done]
    shard = ShardInfo(index=args.shard.index, count=args.shard.count) if args.shard else None
    totals = BuildTotals(
        built=states.count("built"),
        up_to_date=states.count("up-to-date"),
        failed=states.count("failed"),
    )
    return BuildReport(shard=shard, targets=done, totals=totals, error=error)


def _print_built(label: str, result, out) -> None:
    m = result.manifest
    if result.up_to_date:
        signed = result.report.get("signed")
        how = f"; signed with key id {result.report['key']}: {signed}" if signed else ""
        say(f"{label}: up to date ({result.bundle}){how}", file=out)
        return
    r, fid = result.report, m.fidelity
    check = (
        f", fidelity max|dlogit| {fid.max_abs_logit_diff:.3g} greedy_match {fid.greedy_match}"
        if fid.checked
        else ""
    )
    say(
        f"{label}: {m.tokens.count} tokens (stable {m.tokens.stable_tokens}/{m.tokens.rendered_tokens}), "
        f"{build_time(r)}, {r['tokens_per_second']:,.0f} tok/s, "
        f"peak {r['peak_memory_bytes'] / 2**20:,.0f} MiB{check} -> {result.bundle}",
        file=out,
    )
    say(f"  {r['reuse']}", file=out)


def build_time(report: dict) -> str:
    """'built in 61.2s (prefill 6.1s, fidelity check 53.0s, write 0.4s)': the whole wait and
    the phases that make it (an old report without the total: the prefill alone)."""
    total = report.get("build_seconds")
    if total is None:
        return f"prefill {report['prefill_seconds']:.2f}s"
    phases = [("prefill", report["prefill_seconds"])]
    for name, key in (("fidelity check", "check_seconds"), ("write", "write_seconds")):
        if report.get(key, 0.0) >= 0.005:  # a phase that ran (no check: 0.0)
            phases.append((name, report[key]))
    said = ", ".join(f"{name} {_seconds(value)}" for name, value in phases)
    return f"built in {_seconds(total)} ({said})"


def _seconds(value: float) -> str:
    return f"{value:.2f}s" if value < 10 else f"{value:.1f}s"
