"""What decides a prefill's bytes besides its inputs: the device, the mlx build and the BLAS.

The same build with OpenBLAS and with mlx-cpu's own reference BLAS differs in the last bits (so
does another OpenBLAS core, which picks other blocking, and very likely another Metal GPU family).
`kernels()` names each of them in one line that the manifest records (builder.kernels) and the
build key hashes, so two builders whose kernels differ never claim the same identity, and an
incremental build continues only a parent made by the same kernels.
"""

from __future__ import annotations

import ctypes
import os
import platform
from importlib import metadata
from pathlib import Path

from pipeline.blas import blas_status, mapped_libraries
from pipeline.format.fingerprint import sha256_file_memo

BACKEND_PACKAGES = ("mlx-metal", "mlx-cuda", "mlx-cpu")  # the wheel that holds libmlx


def kernels() -> str:
    """One line naming the device, mlx build and BLAS this process prefills with."""
    return "; ".join((_device(), _mlx_build(), _blas()))


def _device() -> str:
    import mlx.core as mx

    kind = mx.default_device().type.name
    if kind == "gpu" and platform.system() == "Darwin":
        info = mx.metal.device_info()
        return f"gpu {info.get('architecture', '?')} ({info.get('device_name', '?')})"
    return f"{kind} {platform.machine()}"


def _mlx_build() -> str:
    """The backend wheel and version, and the digest of the libmlx the process runs."""
    import mlx.core as mx

    wheels = [f"{p} {v}" for p in BACKEND_PACKAGES if (v := _version(p)) is not None]
    library = Path(mx.__file__).parent / "lib" / "libmlx.so"
    if not library.is_file():
        library = Path(mx.__file__).parent / "lib" / "libmlx.dylib"
    digest = sha256_file_memo(library)[:16] if library.is_file() else "not found"
    return f"mlx {mx.__version__} ({', '.join(wheels) or 'source build'}; libmlx {digest})"


def _blas() -> str:
    status = blas_status()
    if platform.system() == "Darwin":
        return "blas Accelerate"
    if status.active and status.library:
        return f"blas {_openblas_config(status.library)}"
    bundled = sorted(os.path.basename(p) for p in mapped_libraries() if "/libblas" in p)
    return f"blas {bundled[0] if bundled else 'mlx-cpu reference'} (no system OpenBLAS loaded)"


def _openblas_config(library: str) -> str:
    """'OpenBLAS 0.3.21 ... core Cooperlake': its version, build options and the core it chose."""
    try:
        lib = ctypes.CDLL(library)
        lib.openblas_get_config.restype = ctypes.c_char_p
        lib.openblas_get_corename.restype = ctypes.c_char_p
        config = lib.openblas_get_config().decode(errors="replace")
        core = lib.openblas_get_corename().decode(errors="replace")
    except (OSError, AttributeError):
        return f"{os.path.basename(library)} (version unknown)"
    return f"{config.strip()} core {core.strip()}"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


__all__ = ["kernels"]
