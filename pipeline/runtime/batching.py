"""Prompt caches for mlx_lm.server's batched path, which merges each layer with `merge`.

Every cache kind a bundle can hold has `merge` except QuantizedKVCache; the batched path raises on
it ("does not yet support batching with history") inside the generation thread. A quantized layer is
handed over dequantized: the same keys and values the quantized attention multiplies with, in a
KVCache (measured on the demo's 8-bit bundle: max|dlogit| 3e-5 from continuing the quantized cache).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import mlx.core as mx


class NotBatchable(Exception):
    """A cache layer the batched path cannot merge and that has no batchable equivalent."""


def for_batching(cache: Sequence[Any]) -> list:
    """`cache` with every layer mergeable by the batched path; `cache` itself is never written.

    Mergeable layers are passed through as they are; quantized KV layers become new KVCache objects
    over dequantized arrays. Raises NotBatchable naming the first layer that has no such form.
    """
    return [_layer(layer, f"layer {i}") for i, layer in enumerate(cache)]


def _layer(layer: Any, where: str) -> Any:
    """One layer in a mergeable form (the same object when it already is one)."""
    children = getattr(layer, "caches", None)
    if isinstance(children, list | tuple):  # CacheList: merges child by child
        converted = [_layer(c, f"{where}.{j}") for j, c in enumerate(children)]
        if all(a is b for a, b in zip(converted, children, strict=True)):
            return layer
        out = copy.copy(layer)
        out.caches = tuple(converted)
        return out
    if _is_quantized(layer):
        return _dequantized(layer)
    if hasattr(type(layer), "merge"):
        return layer
    raise NotBatchable(f"{where} is a {type(layer).__name__}, which has no batched form")


def _is_quantized(layer: Any) -> bool:
    """A QuantizedKVCache (by name and shape of state: the runtime does not import mlx_lm)."""
    names = {cls.__name__ for cls in type(layer).__mro__}
    return "QuantizedKVCache" in names and hasattr(layer, "bits") and hasattr(layer, "group_size")


def _dequantized(layer: Any) -> Any:
    """A KVCache holding `layer`'s first `offset` keys and values, dequantized."""
    from mlx_lm.models.cache import KVCache  # only a server with mlx_lm loaded gets here

    out = KVCache()
    out.offset = int(layer.offset)
    if layer.keys is not None and out.offset > 0:
        end = out.offset
        out.keys, out.values = (
            mx.dequantize(
                *(x[..., :end, :] for x in part), group_size=layer.group_size, bits=layer.bits
            )
            for part in (layer.keys, layer.values)
        )
        mx.eval(out.keys, out.values)
    else:
        out.offset = 0
    return out
