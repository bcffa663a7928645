"""Helpers for .github/workflows/release-bundles.yml; each prints what one workflow step needs.

  models [PREFIX...]          GITHUB_OUTPUT lines: the hub models (repo@revision) the definitions
                              name, a cache key over them, and whether the demo model must be made
  verify-groups BUILD_JSON    one line per model folder: "<model dir>\\t<bundle>\\t<bundle>..." for
                              the bundles `build --json` built or found up to date
  summary BUILD_JSON...       a Markdown table (prefix, model, status, tokens, bytes, prefill s)

Run from the repository root, after `pip install -e .`.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

PREFIXES = Path("prefixes")
DEMO_MODEL = "models/demo-tiny"  # made by `python build.py demo-model`, not downloaded


def models(names: list[str]) -> list[str]:
    """GITHUB_OUTPUT lines for the hub models of the named definitions (all when none)."""
    from pipeline.builder.batch import select_definitions

    specs = [(d.name, m) for d in select_definitions(PREFIXES, names) for m in d.spec.models]
    hub = sorted({f"{m.repo}@{m.revision}" for _, m in specs if m.repo})
    keyed = sorted(f"{name} {m.repo}@{m.revision}" for name, m in specs if m.repo)
    demo = any(m.path == DEMO_MODEL and not Path(DEMO_MODEL).is_dir() for _, m in specs)
    return [
        f"hub-models={' '.join(hub)}",
        f"hub-key={hashlib.sha256(chr(10).join(keyed).encode()).hexdigest()[:16]}",
        f"demo-model={'true' if demo else 'false'}",
    ]


def verify_groups(build_json: Path) -> list[str]:
    """Bundles of one build report grouped by the model folder they are verified against."""
    groups: dict[str, list[str]] = {}
    for t in _targets(build_json):
        if t["status"] != "failed":
            groups.setdefault(str(model_dir(t["model"])), []).append(t["path"])
    return ["\t".join([folder, *paths]) for folder, paths in groups.items()]


def model_dir(ref: str) -> Path:
    """The folder of a model as `build --json` names it: models.path, or models.repo@revision."""
    from pipeline.builder.definition import ModelSpec
    from pipeline.builder.targets import resolve_model

    root = PREFIXES.resolve().parent
    repo, at, revision = ref.rpartition("@")
    if at and not (root / ref).exists():
        return resolve_model(ModelSpec(repo=repo, revision=revision), root)  # the cached snapshot
    return resolve_model(ModelSpec(path=ref), root)


def summary(build_jsons: list[Path]) -> list[str]:
    """The job summary: one row per build target of every report, then any build error."""
    rows = [
        "| prefix | model | status | tokens | reused | bytes | prefill s |",
        "|---|---|---|--:|--:|--:|--:|",
    ]
    errors = []
    for path in build_jsons:
        report = json.loads(path.read_text(encoding="utf-8"))
        for t in report["targets"]:
            rows.append(
                f"| {t['prefix']}@{t['version']} | `{t['model']}` | {t['status']} "
                f"| {_number(t['tokens'])} | {_number(t.get('reused_tokens'))} | {_number(t['bytes'])} "
                f"| {_number(t['prefill_seconds'], '{:.2f}')} |"
            )
        if report.get("error"):
            errors.append(f"**{path}**: `error: {report['error']}`")
    return rows + ([""] + errors if errors else [])


def _targets(build_json: Path) -> list[dict]:
    return json.loads(Path(build_json).read_text(encoding="utf-8"))["targets"]


def _number(value: float | None, fmt: str = "{:,}") -> str:
    return "–" if value is None else fmt.format(value)


def main(argv: list[str]) -> int:
    command, args = (argv[0], argv[1:]) if argv else ("", [])
    if command == "summary":  # reads JSON only: runs where the project is not installed
        print("\n".join(summary([Path(a) for a in args])))
        return 0
    if command not in ("models", "verify-groups"):
        print("usage: release.py models|verify-groups|summary ARG...", file=sys.stderr)
        return 2
    from pipeline.format.errors import PipelineError

    try:
        lines = models(args) if command == "models" else verify_groups(Path(args[0]))
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
