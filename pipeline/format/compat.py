"""Which mlx-lm this runtime supports, its cache-file layout, and the cache classes it rebuilds."""

from __future__ import annotations

from importlib import metadata
from typing import Any

from pipeline.format.errors import PipelineError
from pipeline.format.names import parse_index

# mlx-lm minors whose prompt-cache file layout has a codec and a CI job (latest patch of each;
# tested: 0.31.3 and 0.32.2). pyproject pins the same range.
SUPPORTED_MLX_LM = ((0, 31), (0, 33))
SUPPORTED_RANGE = ">=0.31,<0.33"  # the same range, as pip writes it
LAYOUT_OF_MINOR = {(0, 31): "mlx-lm-0.31", (0, 32): "mlx-lm-0.32"}
ALLOWED_CACHE_CLASSES = ("KVCache", "QuantizedKVCache", "RotatingKVCache", "ArraysCache")


def _minor(version: str) -> tuple[int, ...]:
    return tuple(n for x in version.split(".")[:2] if (n := parse_index(x)) is not None)


def mlx_lm_supported(version: str) -> bool:
    """Whether an mlx-lm version string falls in SUPPORTED_MLX_LM."""
    parts = _minor(version)
    low, high = SUPPORTED_MLX_LM
    return len(parts) == 2 and low <= parts < high


def layout_for(version: str) -> str | None:
    """The cache-file layout an mlx-lm version writes ("mlx-lm-0.31", ...), None if unsupported."""
    return LAYOUT_OF_MINOR.get(_minor(version)) if mlx_lm_supported(version) else None


def unsupported(version: str, what: str = "installed mlx-lm") -> str:
    """The one-line refusal for an mlx-lm outside the supported range."""
    return (
        f"{what} {version} is outside the supported range {SUPPORTED_RANGE}; "
        f"install a supported one: pip install 'mlx-lm{SUPPORTED_RANGE}'"
    )


def installed_mlx_lm() -> str:
    """The installed mlx-lm version, read without importing it (importing costs seconds)."""
    try:
        return metadata.version("mlx-lm")
    except metadata.PackageNotFoundError:
        return "not installed"


def installed_layout() -> str:
    """The layout the installed mlx-lm writes and whose classes we build; PipelineError if none."""
    version = installed_mlx_lm()
    layout = layout_for(version)
    if layout is None:
        raise PipelineError(unsupported(version))
    return layout


def cache_classes() -> dict[str, Any]:
    """The allow-listed mlx_lm cache classes a bundle may name, by name."""
    from mlx_lm.models import cache as cache_module

    return {n: getattr(cache_module, n) for n in ALLOWED_CACHE_CLASSES}
