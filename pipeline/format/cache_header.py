"""What cache.safetensors must hold for a manifest and a model: every tensor, dtype, shape, scalar.

mlx_lm's save_prompt_cache flattens each layer's `state` into tensors named "<layer>.<i>[.<j>]",
turns Python scalars into 0-d int32 tensors listed in the metadata as "2.<k>.0" (position) and
"2.<k>.1" (kind), the class names into "1.<layer>", and user metadata into "0.<key>". Here the
expected header is derived from the (checked) manifest and the served model's config, and the
file's header must equal it exactly: a relabelled dtype, a cut sequence, a missing layer or an
extra tensor is refused before any tensor is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.format.fingerprint import ModelShape
from pipeline.format.manifest import Manifest
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
class Expected:
    """Expected tensors (name: (dtypes, shape)), scalar entries in order, and scalar values."""

    tensors: dict[str, tuple[frozenset[str], tuple[Dim, ...]]] = field(default_factory=dict)
    scalars: list[tuple[str, str]] = field(default_factory=list)  # (tensor name, kind)
    values: dict[str, int | range] = field(default_factory=dict)

    def scalar(self, name: str, value: int | range) -> None:
        self.tensors[name] = (frozenset({"I32"}), ())
        self.scalars.append((name, "scalar"))
        self.values[name] = value

    def none(self, name: str) -> None:
        self.tensors[name] = (frozenset({"F32"}), (0,))
        self.scalars.append((name, "none"))


def expected_layout(manifest: Manifest, shape: ModelShape, header: Header) -> Expected:
    """The header a correct bundle for this manifest and model has, layer by layer."""
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
    out = Expected()
    float_dtype = frozenset({DTYPE_CODES[c.dtype]})
    heads, head_dim = shape.kv_heads, shape.head_dim
    for i, kind in enumerate(c.classes):
        if kind == "KVCache":
            for j in (0, 1):
                out.tensors[f"{i}.{j}"] = (float_dtype, (1, heads, t, head_dim))
            out.scalar(f"{i}.2", t)
        elif kind == "QuantizedKVCache":
            _quantized(out, i, manifest, shape, float_dtype)
        elif kind == "RotatingKVCache":
            window = range(min(t, shape.sliding_window or t), t + 1)
            for j in (0, 1):
                out.tensors[f"{i}.{j}"] = (float_dtype, (1, heads, window, head_dim))
            out.scalar(f"{i}.2", t)
            out.scalar(f"{i}.3", range(0, t + 1))
            out.scalar(f"{i}.4", shape.sliding_window or range(1, 1 << 40))
            out.scalar(f"{i}.5", range(0, t + 1))
        else:  # ArraysCache: per-architecture state arrays (conv/ssm), batch 1, floating
            _arrays(out, i, header)
    return out


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


def _quantized(out: Expected, i: int, manifest: Manifest, shape: ModelShape, dtype) -> None:
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


def _arrays(out: Expected, i: int, header: Header) -> None:
    scalar_kinds = _scalar_entries(header.metadata)
    names = sorted(
        (t.name for t in header.tensors if t.name.startswith(f"{i}.0.")),
        key=lambda n: int(n.rsplit(".", 1)[1]) if n.rsplit(".", 1)[1].isdigit() else -1,
    )
    for name in names:
        if scalar_kinds.get(name) == "none":
            out.none(name)
        else:
            out.tensors[name] = (FLOAT_CODES, (1, None, None, None)[: _rank(header, name)])
    out.none(f"{i}.1")
    out.none(f"{i}.2")


def _rank(header: Header, name: str) -> int:
    return max(1, len(header.by_name()[name].shape))


def _scalar_entries(metadata: dict[str, str]) -> dict[str, str]:
    """{tensor name: kind} from the "2.<k>.0"/"2.<k>.1" metadata entries."""
    out = {}
    k = 1
    while f"2.{k}.0" in metadata:
        out[metadata[f"2.{k}.0"]] = metadata.get(f"2.{k}.1", "")
        k += 1
    return out


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
    _check_same_dims(tensors, expected)
    _check_metadata(header.metadata, expected, manifest)
    scalar_names = {name for name, _ in expected.scalars}
    nbytes = sum(t.end - t.start for t in header.tensors if t.name not in scalar_names)
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


def _check_same_dims(tensors: dict[str, Tensor], expected: Expected) -> None:
    """Keys and values of one layer share their shape; KV layers agree on heads and head_dim."""
    kv = {}
    for name in expected.tensors:
        layer, _, rest = name.partition(".")
        if rest in ("0", "1", "0.1", "1.1") and len(tensors[name].shape) == 4:
            kv.setdefault(layer, set()).add(tensors[name].shape)
    for layer, shapes in kv.items():
        if len(shapes) != 1:
            raise LayoutError(f"layer {layer}: keys and values differ in shape {sorted(shapes)}")
    heads = {next(iter(s))[1] for s in kv.values()}
    if len(heads) > 1:
        raise LayoutError(f"KV layers disagree on the number of heads {sorted(heads)}")


def _check_metadata(metadata: dict[str, str], expected: Expected, manifest: Manifest) -> None:
    want = {f"1.{i}": kind for i, kind in enumerate(manifest.cache.classes)}
    want["2.0"] = ""
    for k, (name, kind) in enumerate(expected.scalars, start=1):
        want[f"2.{k}.0"], want[f"2.{k}.1"] = name, kind
    user = {k: v for k, v in metadata.items() if k.startswith("0.")}
    for key, value in want.items():
        if metadata.get(key) != value:
            raise LayoutError(
                f"cache.safetensors metadata {key!r} is {metadata.get(key)!r}, expected {value!r}"
            )
    unknown = sorted(set(metadata) - set(want) - {f"0.{k}" for k in USER_KEYS})
    missing = [k for k, required in USER_KEYS.items() if required and f"0.{k}" not in user]
    if unknown or missing:
        raise LayoutError(
            f"cache.safetensors metadata has unexpected keys {unknown[:4]} or lacks {missing}"
        )


def check_scalars(values: dict[str, int], expected: Expected) -> None:
    """The scalar state (offsets, group size, bits, window) as the manifest and model require."""
    for name, want in expected.values.items():
        got = values[name]
        if got not in want if isinstance(want, range) else got != want:
            shown = f"{want.start}..{want.stop - 1}" if isinstance(want, range) else want
            raise LayoutError(f"cache state {name} is {got}, expected {shown}")
