"""A system OpenBLAS for mlx on Linux, whatever was imported first: mlx-cpu's own BLAS is ~40x slower.

Importing this module (or `pipeline`) changes nothing. The entry points (build.py, the console
script and so serve, the bench, the examples) call `ensure_fast_blas(argv)` first: before mlx is
imported it loads OpenBLAS into the process; after, it re-executes the process with the library
in LD_PRELOAD, once (as `serve --huge-pages on` re-executes with its tunable).
"""

from __future__ import annotations

import ctypes
import glob
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipeline.reexec import execute, reexec_argv

# Debian/Ubuntu (libopenblas0-pthread), Fedora/RHEL (openblas), Alpine and generic prefixes.
CANDIDATES = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
)
INSTALL_HINT = "install it with 'apt-get install libopenblas0-pthread' (Debian/Ubuntu)"
OVERRIDE = "PREFIX_BUNDLES_OPENBLAS"  # a library path, or "off"
# Set to the pid that re-executed itself: the same pid seeing it again means the preload failed.
REEXEC_MARKER = "PREFIX_BUNDLES_BLAS_REEXEC"
MAPS = "/proc/self/maps"
_loaded_before_mlx: str | None = None  # the library this process loaded before importing mlx


@dataclass(frozen=True)
class BlasStatus:
    """What was done about the BLAS mlx will use."""

    active: bool  # True when OpenBLAS is loaded ahead of mlx (or not needed: macOS)
    library: str | None
    notice: str  # one line for the user


def find_openblas(env: Mapping[str, str] = os.environ) -> str | None:
    """The system OpenBLAS to use (PREFIX_BUNDLES_OPENBLAS overrides the search), or None."""
    override = env.get(OVERRIDE)
    if override:
        return override if override != "off" and os.path.exists(override) else None
    for pattern in CANDIDATES:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def mapped_libraries(maps: str = MAPS) -> set[str]:
    """The files mapped into this process (Linux), or an empty set where that cannot be read."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            fields = [line.split(None, 5) for line in f]
    except OSError:
        return set()
    return {f[5].strip() for f in fields if len(f) == 6 and f[5].startswith("/")}


def blas_status() -> BlasStatus:
    """The BLAS mlx uses in this process, as things stand; changes nothing."""
    if platform.system() != "Linux":
        return BlasStatus(True, None, "BLAS: platform default (Accelerate/Metal)")
    if os.environ.get(OVERRIDE) == "off":
        return BlasStatus(False, None, f"BLAS: OpenBLAS disabled by {OVERRIDE}=off")
    path = find_openblas()
    if path is None:
        return BlasStatus(
            False,
            None,
            f"BLAS: no system OpenBLAS found; float32 prefill is ~40x slower, {INSTALL_HINT}",
        )
    real = os.path.realpath(path)
    if real in mapped_libraries() and (_preloaded(path) or _loaded_before_mlx == path):
        how = "preloaded" if _preloaded(path) else "loaded before mlx"
        return BlasStatus(True, path, f"BLAS: using system OpenBLAS {path} ({how})")
    if "mlx.core" not in sys.modules:
        return BlasStatus(False, path, f"BLAS: OpenBLAS {path} not loaded yet (mlx not imported)")
    return BlasStatus(
        False,
        path,
        f"BLAS: mlx was imported before OpenBLAS {path} was loaded, so mlx-cpu's own ~40x slower "
        f"BLAS is in use; start the process with LD_PRELOAD={path}",
    )


def ensure_fast_blas(argv: Sequence[str] | None = None) -> BlasStatus:
    """Entry points: get mlx OpenBLAS on Linux; `argv` (the process's arguments) allows a re-exec."""
    global _loaded_before_mlx
    status = blas_status()
    if status.active or status.library is None:
        return status
    if "mlx.core" not in sys.modules:
        try:
            ctypes.CDLL(status.library, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            return BlasStatus(
                False, None, f"BLAS: could not load {status.library} ({exc}); {INSTALL_HINT}"
            )
        _loaded_before_mlx = status.library
        return blas_status()
    if os.environ.pop(REEXEC_MARKER, None) == str(os.getpid()):  # this process is the re-exec
        why = f"re-executed with LD_PRELOAD={status.library} but it is not loaded"
        return BlasStatus(False, status.library, f"BLAS: {why}; mlx-cpu's own BLAS is in use")
    command = None if argv is None else reexec_argv(argv, sys.orig_argv, sys.executable)
    if command is not None:
        execute(command, with_preload(os.environ, status.library, os.getpid()))
    return status


def with_preload(env: Mapping[str, str], library: str, pid: int) -> dict[str, str]:
    """A copy of env with `library` first in LD_PRELOAD and the re-exec marker set."""
    preload = " ".join([library, *env.get("LD_PRELOAD", "").split()])
    return {**env, "LD_PRELOAD": preload, REEXEC_MARKER: str(pid)}


def _preloaded(path: str) -> bool:
    real = os.path.realpath(path)
    return any(
        os.path.realpath(p) == real
        for p in os.environ.get("LD_PRELOAD", "").replace(":", " ").split()
    )
