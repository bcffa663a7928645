"""Load a system OpenBLAS before mlx on Linux, so mlx-cpu's float32 matmul is not ~40x slower."""

from __future__ import annotations

import ctypes
import glob
import os
import platform
import sys
from dataclasses import dataclass

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
_status: BlasStatus | None = None


@dataclass(frozen=True)
class BlasStatus:
    """What was done about the BLAS mlx will use."""

    active: bool  # True when OpenBLAS is loaded ahead of mlx (or not needed: macOS)
    library: str | None
    notice: str  # one line for the user


def _find_openblas() -> str | None:
    override = os.environ.get("PREFIX_BUNDLES_OPENBLAS")
    if override:
        return override if os.path.exists(override) else None
    for pattern in CANDIDATES:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def ensure_fast_blas() -> BlasStatus:
    """Load OpenBLAS globally before the first `import mlx` (Linux only); idempotent."""
    global _status
    if _status is not None:
        return _status
    if platform.system() != "Linux":
        _status = BlasStatus(True, None, "BLAS: platform default (Accelerate/Metal)")
    elif os.environ.get("PREFIX_BUNDLES_OPENBLAS") == "off":
        _status = BlasStatus(False, None, "BLAS: OpenBLAS disabled by PREFIX_BUNDLES_OPENBLAS=off")
    elif "mlx.core" in sys.modules:
        _status = BlasStatus(
            False, None, "BLAS: mlx was imported before pipeline; OpenBLAS fast path not applied"
        )
    else:
        _status = _load_openblas()
    return _status


def _load_openblas() -> BlasStatus:
    path = _find_openblas()
    if path is None:
        return BlasStatus(
            False,
            None,
            f"BLAS: no system OpenBLAS found; float32 prefill is ~40x slower, {INSTALL_HINT}",
        )
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        return BlasStatus(False, None, f"BLAS: could not load {path} ({exc}); {INSTALL_HINT}")
    return BlasStatus(True, path, f"BLAS: using system OpenBLAS {path}")
