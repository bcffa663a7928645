"""The cache-file layout mlx-lm 0.32 writes, and its cache classes' `from_state(state)`.

save_prompt_cache flattens each layer's `state` (arrays and scalars) into tensors named
"<layer>.<i>[.<j>]"; scalars become 0-d int32 tensors listed in the metadata as "2.<k>.0" (name)
and "2.<k>.1" (kind: "scalar" or "none"); class names are "1.<layer>", user metadata "0.<key>".
A layer's state is the logical state every codec maps to and from.
"""

from __future__ import annotations

from typing import Any

from pipeline.format.cache_header import Expected, Logical, LogicalView
from pipeline.format.safetensors_read import Header

NAME = "mlx-lm-0.32"


def logical_view(header: Header, classes: list[str]) -> LogicalView:
    """The file's tensors under their logical names (this layout's names), and the None entries."""
    return LogicalView(header.by_name(), _none_entries(header.metadata))


def _none_entries(metadata: dict[str, str]) -> frozenset[str]:
    """Tensor names the "2.<k>" metadata entries mark as None."""
    out, k = set(), 1
    while f"2.{k}.0" in metadata:
        if metadata.get(f"2.{k}.1") == "none":
            out.add(metadata[f"2.{k}.0"])
        k += 1
    return frozenset(out)


def file_form(logical: Logical, classes: list[str]) -> Expected:
    """The file this layout writes for a logical layout: every state entry is a tensor."""
    metadata = {f"1.{i}": kind for i, kind in enumerate(classes)}
    metadata["2.0"] = ""
    for k, (name, kind) in enumerate(logical.scalars, start=1):
        metadata[f"2.{k}.0"], metadata[f"2.{k}.1"] = name, kind
    scalar_names = {name for name, _ in logical.scalars}
    return Expected(
        tensors=dict(logical.tensors),
        metadata=metadata,
        user_prefix="0.",
        values=dict(logical.values),
        sources={name: ("tensor", name) for name in logical.values},
        names={name: name for name in logical.tensors if name not in scalar_names},
    )


def classes(metadata: dict[str, str]) -> list[str]:
    """The cache class names a file of this layout lists, in layer order."""
    return [metadata[f"1.{i}"] for i in range(len(metadata)) if f"1.{i}" in metadata]


def decode(arrays: dict[str, Any], metadata: dict[str, str], kinds: list[str]) -> list[Any]:
    """Logical per-layer states from the file's arrays: scalars as ints, "none" entries as None."""
    from mlx.utils import tree_unflatten

    values, k = dict(arrays), 1
    while f"2.{k}.0" in metadata:
        name, kind = metadata[f"2.{k}.0"], metadata.get(f"2.{k}.1")
        if kind not in ("scalar", "none"):
            raise ValueError(f"state entry {name} has kind {kind!r}, expected scalar or none")
        values[name] = values[name].item() if kind == "scalar" else None
        k += 1
    return tree_unflatten(list(values.items()))


def make_layer(cls: type, state: list[Any]) -> Any:
    """A cache object of the installed mlx-lm 0.32 from a logical state."""
    return cls.from_state(state)


def with_state(layer: Any, state: Any) -> Any:
    """A new cache object like `layer` holding `state` (the layer's own state, e.g. cast)."""
    return type(layer).from_state(state)
