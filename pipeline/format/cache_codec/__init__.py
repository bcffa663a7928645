"""One codec per mlx-lm prompt-cache file layout: read either, build the installed mlx-lm's objects.

mlx-lm 0.31 writes metadata `[meta_state info, metadata, classes]` and rebuilds with
`from_state(state, meta_state)`; 0.32 writes `[metadata, classes, scalars]` and calls
`from_state(state)`. The arrays are the same. Each codec maps its file to a logical layout (the
0.32 state order) and builds cache objects from logical state; the validator checks a file against
its manifest's layout and hands out objects for the mlx-lm installed here. Writing uses the
installed mlx-lm's own save_prompt_cache, so its load_prompt_cache reads what we write.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

from pipeline.format.cache_codec import mlx_lm_031, mlx_lm_032
from pipeline.format.cache_header import Expected, LayoutError, expected_layout
from pipeline.format.compat import ALLOWED_CACHE_CLASSES, cache_classes, installed_layout
from pipeline.format.errors import PipelineError
from pipeline.format.fingerprint import ModelShape
from pipeline.format.manifest import DEFAULT_LAYOUT, Manifest
from pipeline.format.safetensors_read import Header

LAYOUTS: dict[str, ModuleType] = {mlx_lm_031.NAME: mlx_lm_031, mlx_lm_032.NAME: mlx_lm_032}


def codec(layout: str) -> ModuleType:
    """The codec module of a layout name ("mlx-lm-0.31" or "mlx-lm-0.32")."""
    if layout not in LAYOUTS:
        raise PipelineError(f"unknown cache-file layout {layout!r}; known: {sorted(LAYOUTS)}")
    return LAYOUTS[layout]


def detect_layout(metadata: dict[str, str]) -> str | None:
    """Which layout wrote a cache file, from its safetensors metadata (None: neither)."""
    if metadata.get("2.0") == "" and metadata.get("1.0") in ALLOWED_CACHE_CLASSES:
        return mlx_lm_032.NAME
    if metadata.get("2.0") in ALLOWED_CACHE_CLASSES:
        return mlx_lm_031.NAME
    return None


def user_metadata(metadata: dict[str, str], layout: str) -> dict[str, str]:
    """The metadata the writer was given ("token_ids", "model", ...), without the layout's keys."""
    prefix = "1." if layout == mlx_lm_031.NAME else "0."
    return {
        k[len(prefix) :]: v
        for k, v in metadata.items()
        if k.startswith(prefix) and "." not in k[len(prefix) :]
    }


def expected_file(manifest: Manifest, shape: ModelShape, header: Header) -> Expected:
    """The exact file the manifest's layout holds for this manifest and model."""
    found = detect_layout(header.metadata)
    if found != manifest.cache.layout:
        raise LayoutError(
            f"cache.safetensors is in the {found or 'no known'} layout but the manifest records "
            f"{manifest.cache.layout}",
            "cache.layout",
        )
    layout = codec(manifest.cache.layout)
    view = layout.logical_view(header, manifest.cache.classes)
    return layout.file_form(expected_layout(manifest, shape, view), manifest.cache.classes)


def rebuild(
    arrays: dict[str, Any], metadata: dict[str, str], layout: str, kinds: list[str]
) -> list[Any]:
    """Cache objects of the installed mlx-lm from a file's arrays (by file name) and metadata."""
    states = codec(layout).decode(arrays, metadata, kinds)
    allowed, make = cache_classes(), codec(installed_layout()).make_layer
    return [make(allowed[c], s) for c, s in zip(kinds, states, strict=True)]


def with_state(layer: Any, state: Any) -> Any:
    """A new cache object of the installed mlx-lm like `layer`, holding `state` (e.g. cast)."""
    return codec(installed_layout()).with_state(layer, state)


def write_cache(path: Path, cache: list[Any], metadata: dict[str, str]) -> str:
    """Save a prompt cache with the installed mlx-lm's save_prompt_cache; return its layout."""
    layout = installed_layout()
    from mlx_lm.models.cache import save_prompt_cache

    save_prompt_cache(str(path), cache, metadata)
    return layout


# how mlx's own writer says it could not write (it raises RuntimeError where Python raises OSError)
MLX_WRITE_FAILURES = ("[write] ", "[save_safetensors] Failed to open ", "[save] Failed to open ")


def write_failure(exc: BaseException) -> str | None:
    """Why a file write failed, for a message, when `exc` is one (OSError, or mlx's RuntimeError
    from a full disk or the file size limit); None for anything else, a bug."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    if isinstance(exc, RuntimeError) and str(exc).startswith(MLX_WRITE_FAILURES):
        return "the disk is full or the file size limit was hit"
    return None


def read_cache(path: Path) -> tuple[list[Any], dict[str, str]]:
    """Cache objects of the installed mlx-lm and the user metadata, from a file of either layout.

    Checks no more than the layout's structure: a bundle goes through the validator
    (pipeline.runtime.mount). For tools, tests and adapters holding a bare cache file.
    """
    import mlx.core as mx

    arrays, metadata = mx.load(str(path), return_metadata=True)
    layout = detect_layout(metadata)
    kinds = codec(layout).classes(metadata) if layout else []
    if layout is None or not set(kinds) <= set(ALLOWED_CACHE_CLASSES):
        raise PipelineError(
            f"{path}: not a prompt-cache file of a known layout ({', '.join(LAYOUTS)}) "
            f"holding only {', '.join(ALLOWED_CACHE_CLASSES)}"
        )
    return rebuild(arrays, metadata, layout, kinds), user_metadata(metadata, layout)


__all__ = [
    "DEFAULT_LAYOUT",
    "LAYOUTS",
    "codec",
    "detect_layout",
    "expected_file",
    "installed_layout",
    "read_cache",
    "rebuild",
    "user_metadata",
    "with_state",
    "write_cache",
    "write_failure",
]
