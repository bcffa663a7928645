"""Which mlx-lm this runtime supports, and the cache classes it may rebuild from a bundle."""

from __future__ import annotations

from importlib import metadata
from typing import Any

# mlx-lm releases whose prompt-cache layout (save_prompt_cache / from_state) we have tested.
SUPPORTED_MLX_LM = ((0, 30), (0, 33))
SUPPORTED_RANGE = ">=0.30,<0.33"  # the same range, as pip writes it (pyproject pins it too)
ALLOWED_CACHE_CLASSES = ("KVCache", "QuantizedKVCache", "RotatingKVCache", "ArraysCache")


def mlx_lm_supported(version: str) -> bool:
    """Whether an mlx-lm version string falls in SUPPORTED_MLX_LM."""
    parts = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
    low, high = SUPPORTED_MLX_LM
    return len(parts) == 2 and low <= parts < high


def installed_mlx_lm() -> str:
    """The installed mlx-lm version, read without importing it (importing costs seconds)."""
    try:
        return metadata.version("mlx-lm")
    except metadata.PackageNotFoundError:
        return "not installed"


def cache_classes() -> dict[str, Any]:
    """The allow-listed mlx_lm cache classes a bundle may name, by name."""
    from mlx_lm.models import cache as cache_module

    return {n: getattr(cache_module, n) for n in ALLOWED_CACHE_CLASSES}
