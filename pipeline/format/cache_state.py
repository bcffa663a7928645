"""What every cache layer of a correct bundle holds, derived from the architecture's own code.

A bundle's cache state is a function of the model config, its token count and the prefill chunk
size. Rather than bound what a file says (a window index anywhere in 0..tokens, conv arrays of
any shape), the validator asks mlx-lm: the model is built from config.json without weights and
the prefill is replayed lazily, chunk by chunk, on zeros. MLX computes shapes as the graph is
built and nothing is ever evaluated, so this costs milliseconds and no memory, and gives every
state array's shape and every meta-state value (offset, keep, max_size, _idx, ...) exactly as a
build writes them.
"""

from __future__ import annotations

import functools
import importlib
import json
from dataclasses import dataclass
from typing import Any

INT_CODES = {"int32": "I32", "uint32": "U32", "int64": "I64", "uint8": "U8", "bool": "BOOL"}


@dataclass(frozen=True)
class Entry:
    """One state entry: logical name ("<layer>.<i>" or "<layer>.<i>.<j>", mlx-lm 0.32's order),
    what it holds ("array", "scalar" or "none") and its shape or value."""

    name: str
    kind: str
    shape: tuple[int, ...] = ()
    dtype: str | None = None  # safetensors code of a non-floating array; None: floating
    value: int = 0


@dataclass(frozen=True)
class LayerState:
    """One layer's state after a build: its class and its entries in order."""

    kind: str
    entries: tuple[Entry, ...]


def lazy_model(config: dict[str, Any]) -> Any:
    """The architecture's model object built from a config, without weights (parameters stay
    lazy: no memory; their initialisers advance MLX's global random state once, as loading a
    model does). Raises when this mlx-lm does not know the architecture."""
    from mlx_lm.utils import MODEL_REMAPPING

    _check_layer_counts(config)
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise ValueError("config.json has no model_type")
    module = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
    return module.Model(module.ModelArgs.from_dict(config))


MAX_LAYERS = 4096  # what a manifest records (cache.classes); a config past it is refused unbuilt
_LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layers", "n_layer")


def _check_layer_counts(config: dict[str, Any], where: str = "") -> None:
    """Refuse a layer count no bundle can record before building that many layers (a config
    with 10**5 layers took 40 s and 9 GB to build lazily, before the identity check refused it)."""
    for key, value in config.items():
        if isinstance(value, dict) and not where:  # text_config, ...: one level down
            _check_layer_counts(value, f"{key}.")
        elif key in _LAYER_KEYS and isinstance(value, int) and value > MAX_LAYERS:
            raise ValueError(
                f"config.json {where}{key} is {value}, over the {MAX_LAYERS} layers a bundle records"
            )


def model_cache_classes(config: dict[str, Any]) -> tuple[str, ...] | None:
    """The cache class per layer as the architecture's own code builds it, from config.json alone;
    None for an architecture this mlx-lm does not know or cannot build from the config."""
    from mlx_lm.models.cache import make_prompt_cache

    try:
        return tuple(type(layer).__name__ for layer in make_prompt_cache(lazy_model(config)))
    except Exception:  # noqa: BLE001 - unknown to this mlx-lm: the config's layer count still applies
        return None


@functools.lru_cache(maxsize=32)
def derived_states(config_json: str, tokens: int, step: int) -> tuple[LayerState, ...]:
    """Every layer's state after prefilling `tokens` tokens in chunks of `step`, as a build
    leaves it (before KV quantization and the cut of KVCache buffers to their offset).

    `config_json` is config.json as canonical JSON (hashable, so results are remembered).
    Raises when the architecture cannot be replayed (the caller refuses the bundle).
    """
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model = _cached_model(config_json)
    cache = make_prompt_cache(model)
    for done in range(0, tokens, step):
        model(mx.zeros((1, min(step, tokens - done)), dtype=mx.int32), cache=cache)
    return tuple(_layer_state(i, layer) for i, layer in enumerate(cache))


@functools.lru_cache(maxsize=4)
def _cached_model(config_json: str) -> Any:
    return lazy_model(json.loads(config_json))


def _entry(name: str, value: Any) -> Entry:
    import mlx.core as mx

    if value is None:
        return Entry(name, "none")
    if isinstance(value, int) and not isinstance(value, bool):
        return Entry(name, "scalar", value=value)
    if isinstance(value, mx.array):
        floating = mx.issubdtype(value.dtype, mx.floating)
        code = None if floating else INT_CODES.get(str(value.dtype).removeprefix("mlx.core."), "?")
        return Entry(name, "array", tuple(value.shape), code)
    raise TypeError(f"state entry {name} is a {type(value).__name__}")


def _layer_state(i: int, layer: Any) -> LayerState:
    """A layer's state in mlx-lm 0.32's logical order, read from the object's own fields, so the
    same replay gives the same answer under mlx-lm 0.31 (whose `state` holds arrays only)."""
    kind = type(layer).__name__
    if kind == "RotatingKVCache":
        values = [layer.keys, layer.values, layer.offset, layer.keep, layer.max_size, layer._idx]
        entries = [_entry(f"{i}.{p}", v) for p, v in enumerate(values)]
    elif kind == "KVCache":
        entries = [_entry(f"{i}.0", layer.keys), _entry(f"{i}.1", layer.values)]
        entries.append(_entry(f"{i}.2", layer.offset))
    elif kind == "ArraysCache":  # 0.32 adds two None entries (batch padding and lengths)
        entries = [_entry(f"{i}.0.{j}", v) for j, v in enumerate(layer.cache)]
        entries += [_entry(f"{i}.1", None), _entry(f"{i}.2", None)]
    else:
        raise TypeError(f"layer {i}: no logical state is known for a {kind}")
    return LayerState(kind, tuple(entries))


__all__ = ["Entry", "LayerState", "derived_states", "lazy_model", "model_cache_classes"]
