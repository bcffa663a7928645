"""The demo job: demo model, every example prefix built, verified and mounted, one row each."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.builder.builder import build
from pipeline.builder.definition import find_definitions, load_definition
from pipeline.builder.prefill import Progress
from pipeline.builder.targets import targets
from pipeline.format.bundle_folder import REPORT_FILE
from pipeline.format.errors import PipelineError
from pipeline.format.manifest import Manifest
from pipeline.runtime import PromptCacheManager, mount, verify
from pipeline.testmodels.model import generate_model


def run_demo(
    prefix_dir: Path,
    bundles_root: Path,
    model_dir: Path,
    progress: Callable[[str], Progress] | None = None,
) -> list[dict[str, Any]]:
    """Build every definition for the demo model, verify and mount; return one row per bundle."""
    if not (Path(model_dir) / "config.json").is_file():
        generate_model(Path(model_dir), "tiny")
    root = Path(prefix_dir).resolve().parent
    built: dict[Path, str] = {}
    seconds: dict[
        Path, float
    ] = {}  # a build's whole time (its report file is written before the end)
    for path in find_definitions(prefix_dir):
        definition = load_definition(path, root)
        for target in targets(definition, root, model_dir):
            label = f"{definition.name}@{definition.version}"
            result = build(
                target, bundles_root, check=True, progress=progress(label) if progress else None
            )
            verify(result.bundle, model_dir)
            built[result.bundle] = "up to date" if result.up_to_date else "built"
            if "build_seconds" in result.report:
                seconds[result.bundle] = result.report["build_seconds"]
    if not built:
        raise PipelineError(f"no prefix definitions (*.toml) in {prefix_dir}/")
    mounted = mount(model_dir, list(built), manager=PromptCacheManager())
    rows = [_row(b.path, b.manifest, b.seconds, built[b.path]) for b in mounted.bundles]
    for row, b in zip(rows, mounted.bundles, strict=True):
        row["build_s"] = seconds.get(b.path, float("nan"))
    return rows


def _row(bundle: Path, manifest: Manifest, mount_seconds: float, status: str) -> dict[str, Any]:
    report = (
        json.loads((bundle / REPORT_FILE).read_text()) if (bundle / REPORT_FILE).is_file() else {}
    )
    return {
        "prefix": manifest.prefix.name,
        "tokens": manifest.tokens.count,
        "bytes": sum(p.stat().st_size for p in bundle.iterdir() if p.is_file()),
        "prefill_s": report.get("prefill_seconds", float("nan")),
        "mount_ms": mount_seconds * 1000,
        "status": status,
    }
