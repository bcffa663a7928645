"""What cache.safetensors must hold for a manifest and a model: every tensor, dtype, shape, scalar.

The expected layout is derived from the (checked) manifest and the served model's config, first
as a logical layout (each layer's state as mlx-lm 0.32 orders it: arrays, then scalars), then as
the file a layout generation writes for it (pipeline.format.cache_codec: 0.31 keeps scalars in the
metadata, 0.32 in 0-d tensors). The file's header must equal it exactly: a relabelled dtype, a cut
sequence, a missing layer or an extra tensor is refused before any tensor is read.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field

from pipeline.format.cache_state import LayerState, derived_states
from pipeline.format.fingerprint import ModelShape
from pipeline.format.manifest import Manifest
from pipeline.format.names import parse_index
from pipeline.format.safetensors_read import Header, Tensor

DTYPE_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
FLOAT_CODES = frozenset(DTYPE_CODES.values())
USER_KEYS = {"token_ids": True, "model": False, "tokenizer_config": False}  # name: required
Dim = int | range | None  # exact size, allowed range, or any size


class LayoutError(ValueError):
    """The file's header is not what the manifest and the model call for; args: (message, field)."""

    def __init__(self, message: str, field: str = "cache.safetensors") -> None:
        super().__init__(message)
        self.field = field


@dataclass
class Logical:
    """Expected state tensors (logical name: (dtypes, shape)), scalar entries in order, values."""

    tensors: dict[str, tuple[frozenset[str], tuple[Dim, ...]]] = field(default_factory=dict)
    scalars: list[tuple[str, str]] = field(default_factory=list)  # (logical name, kind)
    values: dict[str, int | range] = field(default_factory=dict)

    def scalar(self, name: str, value: int | range) -> None:
        self.tensors[name] = (frozenset({"I32"}), ())
        self.scalars.append((name, "scalar"))
        self.values[name] = value

    def none(self, name: str) -> None:
        self.tensors[name] = (frozenset({"F32"}), (0,))
        self.scalars.append((name, "none"))


@dataclass(frozen=True)
class LogicalView:
    """A file's tensors under their logical names, and the logical names it marks as None."""

    tensors: dict[str, Tensor]
    nones: frozenset[str]


@dataclass(frozen=True)
class Expected:
    """The file a layout writes: tensors by file name, exact metadata, where each scalar is."""

    tensors: dict[str, tuple[frozenset[str], tuple[Dim, ...]]]
    metadata: dict[str, str]  # structural keys and their exact values
    user_prefix: str  # user metadata keys ("token_ids", ...) carry this prefix
    values: dict[str, int | range]  # logical scalar name: required value
    sources: dict[str, tuple[str, str]]  # logical scalar: ("tensor"|"meta"|"shape", file name/key)
    names: dict[str, str]  # file tensor name: logical name, for the arrays (not scalars)


def expected_layout(manifest: Manifest, shape: ModelShape, view: LogicalView) -> Logical:
    """The logical layout a correct bundle for this manifest and model has, layer by layer."""
    c, t = manifest.cache, manifest.tokens.count
    _check_classes(c.classes, shape.cache_classes, c.kv_bits)
    if shape.layers and len(c.classes) != shape.layers:
        raise LayoutError(
            f"the bundle has {len(c.classes)} cache layers but the model has {shape.layers}",
            "cache.classes",
        )
    if (c.kv_bits is None) != ("QuantizedKVCache" not in c.classes):
        raise LayoutError(
            f"cache.kv_bits {c.kv_bits} does not fit the cache classes {sorted(set(c.classes))}",
            "cache.kv_bits",
        )
    out = Logical()
    float_dtype = frozenset({DTYPE_CODES[c.dtype]})
    derived = _derived(manifest, shape)
    heads, head_dim = shape.kv_heads, shape.head_dim
    for i, kind in enumerate(c.classes):
        if kind == "KVCache":
            for j in (0, 1):
                out.tensors[f"{i}.{j}"] = (float_dtype, (1, heads, t, head_dim))
            out.scalar(f"{i}.2", t)
        elif kind == "QuantizedKVCache":
            _quantized(out, i, manifest, shape, float_dtype)
        elif derived is not None:  # rotating windows, conv/ssm state: exactly what a build writes
            _derived_layer(out, i, kind, derived[i], float_dtype, c.layout)
        elif kind == "RotatingKVCache":
            window = range(min(t, shape.sliding_window or t), t + 1)
            for j in (0, 1):
                out.tensors[f"{i}.{j}"] = (float_dtype, (1, heads, window, head_dim))
            out.scalar(f"{i}.2", t)
            out.scalar(f"{i}.3", range(0, t + 1))
            out.scalar(f"{i}.4", shape.sliding_window or range(1, 1 << 40))
            out.scalar(f"{i}.5", range(0, t + 1))
        else:  # ArraysCache: per-architecture state arrays (conv/ssm), batch 1, floating
            _arrays(out, i, view)
    return out


def _derived(manifest: Manifest, shape: ModelShape) -> tuple[LayerState, ...] | None:
    """Every layer's state as a build leaves it, when the bundle has layers whose state is not
    plain KV and the served model's config is known (pipeline.format.cache_state)."""
    c = manifest.cache
    if shape.config_json is None or not {"RotatingKVCache", "ArraysCache"} & set(c.classes):
        return None
    try:
        layers = derived_states(shape.config_json, manifest.tokens.count, c.prefill_step_size)
    except Exception as exc:  # noqa: BLE001 - what cannot be derived is refused, never guessed
        detail = " ".join(str(exc).split())[:160]
        raise LayoutError(
            f"the cache state this model builds cannot be derived ({type(exc).__name__}: {detail})",
            "cache.classes",
        ) from None
    if len(layers) != len(c.classes):
        raise LayoutError(
            f"the bundle has {len(c.classes)} cache layers but the model builds {len(layers)}",
            "cache.classes",
        )
    return layers


def _derived_layer(
    out: Logical, i: int, kind: str, layer: LayerState, float_dtype, layout: str
) -> None:
    """A layer's every state tensor and scalar, exactly as derived for this model; mlx-lm 0.31
    saves a rotating window cut to its offset, 0.32 as it is."""
    if layer.kind != kind:
        raise LayoutError(
            f"layer {i} holds a {kind} but the model builds a {layer.kind} there", "cache.classes"
        )
    offset = next((e.value for e in layer.entries if e.name == f"{i}.2"), 0)
    for e in layer.entries:
        if e.kind == "array":
            shape = e.shape
            if kind == "RotatingKVCache" and layout == "mlx-lm-0.31" and offset < shape[2]:
                shape = (*shape[:2], offset, *shape[3:])
            dtypes = float_dtype if e.dtype is None else frozenset({e.dtype})
            out.tensors[e.name] = (dtypes, shape)
        elif e.kind == "scalar":
            out.scalar(e.name, e.value)
        else:
            out.none(e.name)


def _check_classes(found: list[str], model: tuple[str, ...] | None, kv_bits: int | None) -> None:
    """Each layer holds the cache class the model builds for it (KVCache may be quantized)."""
    if model is None:
        return
    if len(found) != len(model):
        raise LayoutError(
            f"the bundle has {len(found)} cache layers but the model builds {len(model)}",
            "cache.classes",
        )
    for i, (got, want) in enumerate(zip(found, model, strict=True)):
        quantized = kv_bits is not None and want == "KVCache" and got == "QuantizedKVCache"
        if got != want and not quantized:
            raise LayoutError(
                f"layer {i} holds a {got} but the model builds a {want} there", "cache.classes"
            )


def _quantized(out: Logical, i: int, manifest: Manifest, shape: ModelShape, dtype) -> None:
    c, t = manifest.cache, manifest.tokens.count
    bits, group, head_dim = c.kv_bits or 0, c.kv_group_size, shape.head_dim
    if head_dim is not None and head_dim % group:
        raise LayoutError(
            f"kv_group_size {group} does not divide the model's head_dim {head_dim}",
            "cache.kv_group_size",
        )
    packed = head_dim * bits // 32 if head_dim else None
    groups = head_dim // group if head_dim else None
    for j in (0, 1):
        out.tensors[f"{i}.{j}.0"] = (frozenset({"U32"}), (1, shape.kv_heads, t, packed))
        out.tensors[f"{i}.{j}.1"] = (dtype, (1, shape.kv_heads, t, groups))
        out.tensors[f"{i}.{j}.2"] = (dtype, (1, shape.kv_heads, t, groups))
    out.scalar(f"{i}.2", t)
    out.scalar(f"{i}.3", group)
    out.scalar(f"{i}.4", bits)


def _index(text: str) -> int:
    """A tensor name's last part as a sort key: its index, or -1 when it is not one."""
    number = parse_index(text)
    return -1 if number is None else number


def _arrays(out: Logical, i: int, view: LogicalView) -> None:
    names = sorted(
        (name for name in view.tensors if name.startswith(f"{i}.0.")),
        key=lambda n: _index(n.rsplit(".", 1)[1]),
    )
    for name in names:
        if name in view.nones:
            out.none(name)
        else:
            rank = max(1, len(view.tensors[name].shape))
            out.tensors[name] = (FLOAT_CODES, (1, None, None, None)[:rank])
    out.none(f"{i}.1")
    out.none(f"{i}.2")


def check_header(header: Header, expected: Expected, manifest: Manifest) -> None:
    """Refuse (LayoutError) any difference between the file's header and the expected one."""
    tensors = header.by_name()
    extra = sorted(set(tensors) - set(expected.tensors))
    missing = sorted(set(expected.tensors) - set(tensors))
    if extra or missing:
        raise LayoutError(
            f"cache.safetensors tensors differ from the manifest's {len(manifest.cache.classes)} "
            f"layers (unexpected: {extra[:4]}, missing: {missing[:4]})"
        )
    for name, (dtypes, dims) in expected.tensors.items():
        _check_tensor(tensors[name], dtypes, dims)
    _check_same_dims(tensors, expected, manifest.cache.classes)
    _check_metadata(header.metadata, expected)
    nbytes = sum(tensors[name].end - tensors[name].start for name in expected.names)
    if nbytes != manifest.cache.nbytes:
        raise LayoutError(
            f"cache arrays hold {nbytes:,} bytes but the manifest records {manifest.cache.nbytes:,}",
            "cache.nbytes",
        )


def _check_tensor(t: Tensor, dtypes: frozenset[str], dims: tuple[Dim, ...]) -> None:
    if t.dtype not in dtypes:
        raise LayoutError(f"tensor {t.name} is {t.dtype}, expected {'/'.join(sorted(dtypes))}")
    ok = len(t.shape) == len(dims) and all(
        d is None or (t_d in d if isinstance(d, range) else t_d == d)
        for t_d, d in zip(t.shape, dims, strict=False)
    )
    if not ok:
        shown = tuple(
            "*" if d is None else (f"{d.start}..{d.stop - 1}" if isinstance(d, range) else d)
            for d in dims
        )
        raise LayoutError(f"tensor {t.name} has shape {list(t.shape)}, expected {list(shown)}")


def _check_same_dims(tensors: dict[str, Tensor], expected: Expected, classes: list[str]) -> None:
    """Keys and values of one layer share their shape; KV layers agree on heads and head_dim."""
    kv = {}
    for name, logical in expected.names.items():
        layer, _, rest = logical.partition(".")
        if classes[int(layer)] != "ArraysCache" and rest in ("0", "1", "0.1", "1.1"):
            kv.setdefault(layer, set()).add(tensors[name].shape)
    for layer, shapes in kv.items():
        if len(shapes) != 1:
            raise LayoutError(f"layer {layer}: keys and values differ in shape {sorted(shapes)}")
    heads = {next(iter(s))[1] for s in kv.values()}
    if len(heads) > 1:
        raise LayoutError(f"KV layers disagree on the number of heads {sorted(heads)}")


def _check_metadata(metadata: dict[str, str], expected: Expected) -> None:
    for key, value in expected.metadata.items():
        if metadata.get(key) != value:
            raise LayoutError(
                f"cache.safetensors metadata {key!r} is {metadata.get(key)!r}, expected {value!r}"
            )
    meta_scalars = {key for kind, key in expected.sources.values() if kind == "meta"}
    user = {f"{expected.user_prefix}{k}": required for k, required in USER_KEYS.items()}
    unknown = sorted(set(metadata) - set(expected.metadata) - meta_scalars - set(user))
    missing = [k for k, required in user.items() if required and k not in metadata]
    missing += sorted(meta_scalars - set(metadata))
    if unknown or missing:
        raise LayoutError(
            f"cache.safetensors metadata has unexpected keys {unknown[:4]} or lacks {missing[:4]}"
        )


def scalar_values(header: Header, small: dict[str, bytes], expected: Expected) -> dict[str, int]:
    """Each logical scalar's value, read where the layout keeps it (tensor, metadata, shape)."""
    out = {}
    for name, (kind, where) in expected.sources.items():
        if kind == "tensor":
            out[name] = struct.unpack("<i", small[where])[0]
        elif kind == "shape":
            out[name] = header.by_name()[where].shape[2]
        else:
            text = header.metadata[where]
            if not re.fullmatch(r"0|[1-9][0-9]{0,18}", text):
                raise LayoutError(
                    f"cache.safetensors metadata {where!r} is {text!r}, expected a whole number"
                )
            out[name] = int(text)
    return out


def check_scalars(values: dict[str, int], expected: Expected) -> None:
    """The scalar state (offsets, group size, bits, window) as the manifest and model require."""
    for name, want in expected.values.items():
        got = values[name]
        if got not in want if isinstance(want, range) else got != want:
            shown = f"{want.start}..{want.stop - 1}" if isinstance(want, range) else want
            raise LayoutError(f"cache state {name} is {got}, expected {shown}")
