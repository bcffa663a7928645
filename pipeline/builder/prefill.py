"""MLX prefill into a prompt cache: the only place that runs the model at build time."""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from pipeline.builder.model_files import load_tokenizer, load_weights
from pipeline.format.bundle_writer import too_many_blocks
from pipeline.format.cache_blocks import block_tokens
from pipeline.format.cache_codec import with_state
from pipeline.format.errors import BuildError
from pipeline.format.fingerprint import ModelShape
from pipeline.format.manifest import MAX_BLOCKS

# (tokens in the cache, total, seconds spent prefilling, of the tokens those reused from a parent)
Progress = Callable[[int, int, float, int], None]


@dataclass
class LoadedModel:
    """A model ready to prefill, with the dtype the serving model's activations have."""

    model: nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    serving_dtype: mx.Dtype
    compute_dtype: mx.Dtype


@dataclass(frozen=True)
class PrefillStats:
    seconds: float
    tokens_per_second: float
    peak_memory_bytes: int


def device_label() -> str:
    """Where the prefill runs, e.g. 'linux-x86_64-cpu' or 'darwin-arm64-gpu'."""
    return f"{platform.system().lower()}-{platform.machine()}-{mx.default_device().type.name}"


def dtype_name(dtype: mx.Dtype) -> str:
    """'bfloat16' for mx.bfloat16."""
    return str(dtype).removeprefix("mlx.core.")


def serving_dtype(model: nn.Module) -> mx.Dtype:
    """The activation dtype the model computes in when served as shipped (its floating weights)."""
    from mlx.utils import tree_flatten

    counts: dict[mx.Dtype, int] = {}
    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            counts[p.dtype] = counts.get(p.dtype, 0) + p.size
    return max(counts, key=counts.get) if counts else mx.float32


def load_model(model_dir: Path, compute: str | None = None) -> LoadedModel:
    """Load weights and tokenizer, computing in `compute` ("model" or "float32"); by default
    float32 on CPU (no fast half-precision CPU path) and the model's own dtype elsewhere."""
    model, config = load_weights(model_dir)  # ModelError naming a broken file
    tokenizer = load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id"))
    dtype = serving_dtype(model)
    compute_dtype = mx.float32 if resolve_compute(compute) == "float32" else dtype
    if compute_dtype != dtype:
        model.set_dtype(compute_dtype)
        mx.eval(model.parameters())  # convert at load: else the first prefill chunk pays for it
    return LoadedModel(model, tokenizer, dtype, compute_dtype)


def resolve_compute(compute: str | None) -> str:
    """The compute choice ("model" or "float32"), or the default for this device."""
    if compute is not None:
        return compute
    return "float32" if mx.default_device().type == mx.DeviceType.cpu else "model"


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of rendered text; the template already placed any BOS, so add none."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def prefill(
    loaded: LoadedModel,
    tokens: list[int],
    step: int,
    progress: Progress | None = None,
    resume: tuple[list[Any], int] | None = None,
) -> tuple[list[Any], PrefillStats]:
    """Run the tokens through the model in chunks of `step`, returning the filled cache; from
    `resume` = (a cache holding the first n tokens, n) when given: the chunks then start at n
    (a continuation: the bytes depend on n, not only on the tokens)."""
    if not tokens:
        raise BuildError("nothing to prefill: the rendered prefix has no tokens")
    cache, first = resume if resume else (make_prompt_cache(loaded.model), 0)
    mx.reset_peak_memory()
    if progress:
        progress(first, len(tokens), 0.0, first)  # the size, before the first chunk runs
    start = time.perf_counter()
    for done in range(first, len(tokens), step):
        _reserve(cache, len(tokens))
        chunk = mx.array(tokens[done : done + step])[None]
        loaded.model(chunk, cache=cache)  # logits stay lazy and are never computed
        mx.eval([c.state for c in cache])
        if progress:
            elapsed = time.perf_counter() - start
            progress(min(done + step, len(tokens)), len(tokens), elapsed, first)
    seconds = time.perf_counter() - start
    computed = len(tokens) - first
    stats = PrefillStats(seconds, computed / max(seconds, 1e-9), mx.get_peak_memory())
    return cache, stats


def _reserve(cache: list[Any], total: int) -> None:
    """Give each plain KVCache layer room for all `total` tokens at once (a layer holding none
    yet is left to its first chunk). mlx-lm grows a KVCache by concatenating its whole buffer
    with one more step every chunk: a prefill of n chunks copied the cache n times, twice the
    cache held at each copy, and the exact-size cut at the end copied it again; reserved, the
    buffer is copied once and is already exact. The values and the positions each chunk reads
    are the same, so are the bytes."""
    for layer in cache:
        if type(layer) is not KVCache or layer.keys is None or layer.keys.shape[2] >= total:
            continue
        layer.keys, layer.values = (
            _grown(a, layer.offset, total) for a in (layer.keys, layer.values)
        )
        mx.eval(layer.keys, layer.values)


def _grown(buffer: mx.array, held: int, total: int) -> mx.array:
    """A buffer of `total` positions along axis 2 starting with the `held` ones of `buffer`."""
    b, heads, _, dim = buffer.shape
    # one pass over the new buffer: the held positions copied, only the rest zero-filled
    rest = mx.zeros((b, heads, total - held, dim), buffer.dtype)
    return mx.concatenate([buffer[..., :held, :], rest], axis=2)


def check_context(definition: Any, tokens: int, shape: ModelShape) -> None:
    """Refuse a prefix longer than the model's context before any prefill is spent on it."""
    limit = shape.max_positions
    if limit is not None and tokens >= limit:  # a request needs at least one more position
        raise BuildError(
            f"{definition.path}: the prefix is {tokens:,} tokens but the model's context is "
            f"{limit:,} (max_position_embeddings); shorten the included documents or split the prefix"
        )


def check_blocks(
    definition: Any, tokens: int, shape: ModelShape, dtype: mx.Dtype, kv_bits: int | None
) -> None:
    """Refuse, before any prefill, a prefix whose cache file would have more token-range blocks
    than a manifest pins (cache.blocks: B by the rule from the estimated bytes per token; the
    writer checks the real file again)."""
    b = block_tokens(estimate_bytes(1, shape, dtype, kv_bits) - (1 << 20))
    if tokens > MAX_BLOCKS * b:
        raise BuildError(f"{definition.path}: {too_many_blocks(tokens, b, -(-tokens // b))}")


def estimate_bytes(tokens: int, shape: ModelShape, dtype: mx.Dtype, kv_bits: int | None) -> int:
    """About how many bytes the bundle's cache file will take (keys and values of every layer)."""
    per_value = (kv_bits / 8 + 4 / 64) if kv_bits else dtype.size  # quantized: packed + scales
    width = (shape.kv_heads or 8) * (shape.head_dim or 128)
    return int(2 * max(shape.layers, 1) * tokens * width * per_value) + (1 << 20)


def finalize_cache(cache: list[Any], dtype: mx.Dtype) -> list[Any]:
    """The prefill's cache as the bundle holds it: every layer's state in the serving dtype (a
    server computing in that dtype holds it so), KV buffers cut to exactly the tokens held.

    Consumes `cache`: each KVCache layer's buffers (rounded up to whole chunks) are released as
    soon as its exact copy exists, so the two never coexist beyond one layer.
    """
    out = []
    for layer in cache:
        if not isinstance(layer, KVCache):  # rotating windows, recurrent/conv state: cast only
            out.append(with_state(layer, tree_map(lambda x: _cast(x, dtype), layer.state)))
            continue
        fresh = KVCache()
        fresh.keys = mx.contiguous(layer.keys[..., : layer.offset, :].astype(dtype))
        fresh.values = mx.contiguous(layer.values[..., : layer.offset, :].astype(dtype))
        fresh.offset = layer.offset
        mx.eval(fresh.keys, fresh.values)
        layer.keys = layer.values = None
        out.append(fresh)
    mx.eval([c.state for c in out])
    return out


def quantize_cache(cache: list[Any], bits: int, group_size: int) -> list[Any]:
    """KVCache layers quantized to `bits` (the others as they are)."""
    out = [_quantize(c, bits, group_size) if isinstance(c, KVCache) else c for c in cache]
    mx.eval([c.state for c in out])
    return out


def _cast(value: Any, dtype: mx.Dtype) -> Any:
    """Floating arrays in the serving dtype; ints, offsets and None as they are."""
    if isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating):
        return value.astype(dtype)
    return value


def check_group_size(definition: Any, head_dim: int | None) -> None:
    """Refuse, before the prefill, a KV group size that does not divide the model's head_dim."""
    group = definition.spec.cache.kv_group_size
    if definition.spec.cache.kv_bits is None or head_dim is None or head_dim % group == 0:
        return
    fits = [g for g in (32, 64, 128) if head_dim % g == 0]
    fix = (
        f"set cache.kv_group_size to {' or '.join(map(str, fits))}"
        if fits
        else "KV quantization needs a head_dim divisible by 32: remove cache.kv_bits"
    )
    raise BuildError(
        f"{definition.path}: cache.kv_group_size {group} does not divide the model's head_dim "
        f"{head_dim}; {fix}"
    )


def _quantize(layer: KVCache, bits: int, group_size: int) -> QuantizedKVCache:
    q = QuantizedKVCache(group_size=group_size, bits=bits)
    q.keys = mx.quantize(layer.keys, group_size=group_size, bits=bits)
    q.values = mx.quantize(layer.values, group_size=group_size, bits=bits)
    q.offset = layer.offset
    return q


def cache_nbytes(cache: list[Any]) -> int:
    """Bytes held by the cache arrays."""
    return sum(c.nbytes for c in cache)
