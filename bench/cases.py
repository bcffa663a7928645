"""The one case protocol and the registry `bench/run.py` loops over.

A case is a module with `run` (measures, returns a JSON-able result), `section` (its RESULTS.md
lines from that result) and, where it has any, `targets` (rows of the targets table). Every
figure a case reports comes from structured output (a worker's JSON line, HTTP usage fields, the
CLI's --json, the clock), never from a log line. Adding a case is one module and one line here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import case_arch
import case_build
import case_concurrency
import case_eta
import case_handout
import case_incremental
import case_memory
import case_mount
import case_oci
import case_servers
import case_sizes
import case_snapshots
import case_tenants
import case_ttft
import serving
from common import Context

Results = dict[str, Any]


@dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[Context, Results], Any]  # (ctx, the results so far) -> this case's result
    section: Callable[[Any, Results], list[str]] | None = None  # its RESULTS.md lines
    targets: Callable[[Any], list[dict[str, Any]]] | None = None  # its rows of the targets table
    needs: tuple[str, ...] = ()  # cases whose results it reads: run before it when it runs
    bench_model: bool = False  # it needs models/bench-* (3.6 GB, generated on first use)
    selectable: bool = True  # named by --cases (False: runs only as another case's need)
    failures: Callable[[Any], dict[str, str]] = lambda result: {}  # parts that failed in a result


def _arch_failures(result: Any) -> dict[str, str]:
    """A broken architecture fails the run, as a failed case does; the others still report."""
    rows = (result or {}).get("rows", [])
    return {f"arch {row['arch']}": row["error"] for row in rows if "error" in row}


REGISTRY: tuple[Case, ...] = (
    Case("build", lambda ctx, r: case_build.run(ctx, r["openblas"]),
         lambda x, r: case_build.section(x), case_build.targets, bench_model=True),
    Case("ttft_bundles", lambda ctx, r: case_ttft.build_bundles(ctx), bench_model=True,
         selectable=False),
    Case("ttft", lambda ctx, r: case_ttft.run(ctx, r["ttft_bundles"]),
         lambda x, r: case_ttft.section(x, r.get("ttft_bundles") or []), case_ttft.targets,
         needs=("ttft_bundles",), bench_model=True),
    Case("mount", lambda ctx, r: case_mount.run(ctx, r["ttft_bundles"][-1]),
         lambda x, r: case_mount.section(x), case_mount.targets, needs=("ttft_bundles",),
         bench_model=True),
    Case("sizes", lambda ctx, r: case_sizes.run(ctx), lambda x, r: case_sizes.section(x),
         case_sizes.targets, bench_model=True),
    Case("memory", lambda ctx, r: case_memory.run(r), lambda x, r: case_memory.section(x),
         case_memory.targets, selectable=False),
    Case("incremental", lambda ctx, r: case_incremental.run(ctx),
         lambda x, r: case_incremental.section(x), case_incremental.targets, bench_model=True),
    Case("oci", lambda ctx, r: case_oci.run(ctx), lambda x, r: case_oci.section(x),
         case_oci.targets, bench_model=True),
    Case("eta", lambda ctx, r: case_eta.run(ctx), lambda x, r: case_eta.section(x),
         bench_model=True),
    Case("handout", lambda ctx, r: case_handout.run(ctx), lambda x, r: case_handout.section(x)),
    Case("arch", lambda ctx, r: case_arch.run(ctx), lambda x, r: case_arch.section(x),
         failures=_arch_failures),
    Case("server_bundles", lambda ctx, r: serving.bundles(ctx), selectable=False),
    Case("servers", lambda ctx, r: case_servers.run(ctx, r["server_bundles"]),
         lambda x, r: case_servers.section(x), needs=("server_bundles",)),
    Case("concurrency", lambda ctx, r: case_concurrency.run(ctx, r["server_bundles"]),
         lambda x, r: case_concurrency.section(x), needs=("server_bundles",)),
    Case("snapshots", lambda ctx, r: case_snapshots.run(ctx),
         lambda x, r: case_snapshots.section(x), bench_model=True),
    Case("tenants", lambda ctx, r: case_tenants.run(ctx), lambda x, r: case_tenants.section(x),
         case_tenants.targets, bench_model=True),
)  # fmt: skip
BY_NAME = {case.name: case for case in REGISTRY}
SELECTABLE = tuple(case.name for case in REGISTRY if case.selectable)


def chosen(names: set[str]) -> list[Case]:
    """The cases to run for the names given, with what they need, in the registry's order."""
    wanted = set(names)
    for name in names:
        wanted.update(BY_NAME[name].needs)
    if wanted & {"ttft_bundles", "sizes", "mount"}:  # memory reads their processes' peaks
        wanted.add("memory")
    return [case for case in REGISTRY if case.name in wanted]
