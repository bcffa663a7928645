"""RESULTS.md sections from the measurements (no measuring here)."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
from importlib.metadata import version
from pathlib import Path
from typing import Any

from common import REPO

GB = 1e9
MACHINE_KEYS = ("cpu", "cores", "memory", "os", "python", "mlx", "mlx-lm", "pipeline", "openblas")


def machine(openblas: str | None) -> dict[str, str]:
    """CPU, cores, memory, versions."""
    import pipeline

    info = _proc_first("/proc/cpuinfo", "model name")
    kib = _proc_first("/proc/meminfo", "MemTotal")
    return {
        "cpu": f"{info or 'unknown'} ({platform.machine()})",
        "cores": str(os.cpu_count()),
        "memory": f"{int(kib.split()[0]) / 2**20:.1f} GiB" if kib else "unknown",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "mlx": version("mlx"),
        "mlx-lm": version("mlx-lm"),
        "pipeline": f"{pipeline.__version__} (git {git_rev()})",
        "openblas": blas_config(openblas),
    }


def _proc_first(path: str, key: str) -> str | None:
    if not Path(path).is_file():
        return None
    for line in Path(path).read_text().splitlines():
        if line.startswith(key):
            return line.split(":", 1)[1].strip()
    return None


def git_rev() -> str:
    """Short commit of the tree measured, marked when pipeline/ had uncommitted changes."""
    run = lambda *a: subprocess.run(a, cwd=REPO, capture_output=True, text=True).stdout.strip()  # noqa: E731
    try:
        dirty = run("git", "status", "--porcelain", "pipeline")
        return run("git", "rev-parse", "--short", "HEAD") + (
            " + uncommitted pipeline/" if dirty else ""
        )
    except OSError:
        return "unknown"


def blas_config(path: str | None) -> str:
    if not path:
        return "none found"
    try:
        lib = ctypes.CDLL(path)
        lib.openblas_get_config.restype = ctypes.c_char_p
        return f"{path} ({lib.openblas_get_config().decode()})"
    except (OSError, AttributeError):
        return path


def cell(s: dict[str, float], fmt: str = "{:.3g}") -> str:
    """'median (min–max)' of a stat dict; the value alone when n == 1."""
    if s["n"] == 1:
        return fmt.format(s["median"])
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}–{fmt.format(s['max'])})"


def heading(title: str, doc: str) -> list[str]:
    """A case's RESULTS.md section opening: its title, then its module docstring past the first
    paragraph (what the case measures)."""
    return [f"## {title}", "", doc.split("\n\n", 1)[1].strip(), ""]


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """A markdown table."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out + [""]


def fidelity(f: dict[str, Any]) -> list[str]:
    """[max |dlogit|, greedy match] cells of a manifest's fidelity record."""
    if not f.get("checked"):
        return ["not checked", "–"]
    return [f"{f['max_abs_logit_diff']:.3g}", "yes" if f["greedy_match"] else "no"]


def targets_section(targets: list[dict[str, Any]]) -> list[str]:
    rows = [[t["target"], t["measured"], "yes" if t["met"] else "**no**"] for t in targets]
    return ["## Targets (issues 5 and 12)", ""] + table(["target", "measured", "met"], rows)
