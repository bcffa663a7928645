"""The cache-file layout mlx-lm 0.31 writes, and its classes' `from_state(state, meta_state)`.

save_prompt_cache stores each layer's arrays (`state`: keys and values, cut to the offset) as
tensors "<layer>.<i>[.<j>]" and its scalars (`meta_state`, decimal strings) in the metadata as
"0.<layer>[.<j>]"; user metadata is "1.<key>", class names "2.<layer>". Logical names are those
of the 0.32 layout (mlx_lm_032): the scalars sit at fixed state positions per class.
"""

from __future__ import annotations

from typing import Any

from pipeline.format.cache_header import Expected, Logical, LogicalView
from pipeline.format.names import parse_index
from pipeline.format.safetensors_read import Header

NAME = "mlx-lm-0.31"
# meta_state position -> logical state position, per class (0.32 keeps scalars in `state`)
META = {
    "KVCache": (),
    "ArraysCache": (),
    "QuantizedKVCache": (2, 3, 4),  # offset, group_size, bits
    "RotatingKVCache": (3, 4, 2, 5),  # keep, max_size, offset, _idx
}


def _logical_name(name: str, classes: list[str]) -> str:
    """ArraysCache keeps its list of arrays as the whole state here, as state[0] in 0.32."""
    layer, _, rest = name.partition(".")
    index = parse_index(layer)  # ASCII digits only: int() would read '٣' and refuse '²'
    if index is not None and index < len(classes) and classes[index] == "ArraysCache":
        return f"{layer}.0.{rest}"
    return name


def logical_view(header: Header, classes: list[str]) -> LogicalView:
    """The file's tensors under their logical names; this layout cannot hold None entries."""
    return LogicalView({_logical_name(t.name, classes): t for t in header.tensors}, frozenset())


def file_form(logical: Logical, classes: list[str]) -> Expected:
    """The file this layout writes for a logical layout: arrays as tensors, scalars as metadata."""
    scalar_names = {name for name, _ in logical.scalars}
    names = {_file_name(n, classes): n for n in logical.tensors if n not in scalar_names}
    metadata, sources = {}, {}
    for i, kind in enumerate(classes):
        metadata[f"2.{i}"] = kind
        if not META[kind]:
            metadata[f"0.{i}"] = ""
        for j, position in enumerate(META[kind]):
            sources[f"{i}.{position}"] = ("meta", f"0.{i}.{j}")
        if kind == "KVCache":  # the offset is the keys' length (0.31's state setter)
            sources[f"{i}.2"] = ("shape", f"{i}.0")
    return Expected(
        tensors={f: logical.tensors[n] for f, n in names.items()},
        metadata=metadata,
        user_prefix="1.",
        values={n: logical.values[n] for n in sources},
        sources=sources,
        names=names,
    )


def _file_name(name: str, classes: list[str]) -> str:
    layer, _, rest = name.partition(".")
    if classes[int(layer)] == "ArraysCache":
        return f"{layer}.{rest.removeprefix('0.')}"
    return name


def classes(metadata: dict[str, str]) -> list[str]:
    """The cache class names a file of this layout lists, in layer order."""
    return [metadata[f"2.{i}"] for i in range(len(metadata)) if f"2.{i}" in metadata]


def decode(arrays: dict[str, Any], metadata: dict[str, str], kinds: list[str]) -> list[Any]:
    """Logical per-layer states (0.32 order) from the file's arrays and meta_state strings."""
    from mlx.utils import tree_unflatten

    stored = tree_unflatten(list(arrays.items()))
    out = []
    for i, (kind, state) in enumerate(zip(kinds, stored, strict=True)):
        if kind == "ArraysCache":
            out.append([state, None, None])
            continue
        logical = [state[0], state[1]] + [None] * len(META[kind])
        for j, position in enumerate(META[kind]):
            logical[position] = int(metadata[f"0.{i}.{j}"])
        if kind == "KVCache":
            logical.append(state[0].shape[2])
        out.append(logical)
    return out


def make_layer(cls: type, state: list[Any]) -> Any:
    """A cache object of the installed mlx-lm 0.31 from a logical (0.32-ordered) state."""
    positions = META[cls.__name__]
    meta = tuple(str(state[p]) for p in positions) if positions else ""
    arrays = state[0] if cls.__name__ == "ArraysCache" else state[:2]
    return cls.from_state(arrays, meta)


def with_state(layer: Any, state: Any) -> Any:
    """A new cache object like `layer` holding `state` (the layer's own state, e.g. cast)."""
    return type(layer).from_state(state, layer.meta_state)
