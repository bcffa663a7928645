"""Copy-on-write copies of prompt caches: new handles over the same buffers, KV buffers cut to
their offset, so a request's first write copies only what it keeps and the original is never
written; and the facts read off a cache object (its arrays, its offsets, whether it is lossy)."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx

from pipeline.format.errors import PipelineError

# Duck-typed on purpose: importing anything under mlx_lm runs mlx_lm/__init__.py, which
# imports transformers and jinja2 (~0.75 s); the runtime must stay thin.
_NARROWED = frozenset({"KVCache", "QuantizedKVCache"})  # cut to offset on hand-out


# mlx-lm's; vllm-mlx's --kv-cache-quantization entries; rapid-mlx's --kv-cache-turboquant ones
QUANTIZED_LAYERS = frozenset({"QuantizedKVCache", "_QuantizedCacheWrapper", "TurboQuantKVCache"})


def is_lossy(cache: Sequence[Any]) -> bool:
    """True when any layer holds quantized KV (by class name: the runtime does not import mlx_lm
    or the servers; QUANTIZED_LAYERS)."""
    for layer in cache:
        children = _children(layer)
        if children is not None and is_lossy(children):
            return True
        if QUANTIZED_LAYERS & {cls.__name__ for cls in type(layer).__mro__}:
            return True
    return False


def fork_value(value: Any) -> Any:
    """Same data, new handles: arrays re-wrapped, containers and cache objects rebuilt."""
    if isinstance(value, mx.array):
        # A new handle over the same buffer. Slice assignment into it rebinds only this
        # handle, and MLX never donates a buffer that another handle still holds.
        return value[...]
    if isinstance(value, list):
        return [fork_value(v) for v in value]
    if isinstance(value, tuple):
        return tuple(fork_value(v) for v in value)
    if isinstance(value, dict):
        return {k: fork_value(v) for k, v in value.items()}
    if hasattr(type(value), "is_trimmable"):  # every mlx_lm cache class, ArraysCache included
        new = copy.copy(value)
        new.__dict__.update({k: fork_value(v) for k, v in vars(value).items()})
        return new
    return value


def cache_arrays(value: Any) -> Iterator[mx.array]:
    """Every array held by a cache, a container of caches, or a container of arrays."""
    if isinstance(value, mx.array):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from cache_arrays(v)
    elif isinstance(value, dict):
        yield from cache_arrays(list(value.values()))
    elif hasattr(value, "__dict__"):
        yield from cache_arrays(list(vars(value).values()))


def _children(layer: Any) -> Sequence[Any] | None:
    """The sub-caches of a CacheList-like layer, else None."""
    children = getattr(layer, "caches", None)
    return children if isinstance(children, list | tuple) else None


def cache_offsets(cache: Sequence[Any]) -> set[int]:
    """The token counts the layers report (caches without an int offset report nothing)."""
    found: set[int] = set()
    for layer in cache:
        if _children(layer) is not None:
            found |= cache_offsets(_children(layer))
        elif isinstance(getattr(layer, "offset", None), int):
            found.add(layer.offset)
    return found


def _narrow(layer: Any) -> None:
    """Cut KV buffers to the offset so the first write copies only the kept prefix."""
    for child in _children(layer) or ():
        _narrow(child)
    names = {cls.__name__ for cls in type(layer).__mro__}
    if not names & _NARROWED or getattr(layer, "keys", None) is None:
        return
    # KVCache keys: one array; QuantizedKVCache keys: (packed, scales, biases).
    end = layer.offset
    if isinstance(layer.keys, mx.array):
        layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
    else:
        layer.keys = tuple(x[..., :end, :] for x in layer.keys)
        layer.values = tuple(x[..., :end, :] for x in layer.values)


def fork_cache(cache: list, trim: int = 0) -> list:
    """A copy-on-write copy of a prompt cache, less its last `trim` tokens: new handles over the
    same buffers, KV buffers cut to their offset, so the first write copies only what is kept
    (one copy, where copy.deepcopy and a first write make two) and `cache` is never written."""
    if not isinstance(trim, int) or trim < 0:
        raise PipelineError(f"fork_cache: trim must be 0 or more tokens, got {trim!r}")
    out = [fork_value(layer) for layer in cache]
    for layer in out:
        if trim:
            layer.trim(trim)
        _narrow(layer)
    mx.eval(list(cache_arrays(out)))  # slices are views: cheap, and usable from any thread
    return out


__all__ = [
    "QUANTIZED_LAYERS",
    "cache_arrays",
    "cache_offsets",
    "fork_cache",
    "fork_value",
    "is_lossy",
]
