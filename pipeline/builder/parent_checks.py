"""Spot checks of a parent neither signed nor built here (`build --parent-check sample|chunks`).

Both recompute part of the parent from its own token ids on top of its own stored positions and
compare with what it stores. Neither is a proof: whoever can write a parent can recompute the
positions after a forged one from the forged state, so the checked parts match while another is
wrong. They catch a gross edit of what they look at.
"""

from __future__ import annotations

from typing import Any

SPOT_CHECK_DIFFERS = "recomputed from token 0"  # how a refusal for a part that differs opens
WINDOW = 64  # tokens per window of the sample check
# within float tolerance: a window shorter than the parent's chunk differs in the last bits; a
# half-precision parent also differs by its rounding (about one bfloat16 ulp, 2^-8 relative)
TOLERANCE = {"float32": (1e-3, 1e-4), "float16": (4e-3, 1e-3), "bfloat16": (1.6e-2, 1e-3)}


def replay(layers: list[Any], done: int, dtype: Any) -> list[Any]:
    """Fresh KVCache layers holding the first `done` stored positions of `layers` in `dtype` (the
    compute dtype: bfloat16 upcasts exactly to float32). New handles over the parent's data: a
    write into them lands in a new buffer, never in the parent's arrays."""
    from mlx_lm.models.cache import KVCache

    out = [KVCache() for _ in layers]
    for fresh, layer in zip(out, layers, strict=True):
        fresh.keys = layer.keys[..., :done, :].astype(dtype)
        fresh.values = layer.values[..., :done, :].astype(dtype)
        fresh.offset = done
    return out


def _recompute(model: Any, layers: list[Any], tokens: list[int], start: int, end: int) -> list:
    """The K/V of positions start..end recomputed on top of the stored positions before them, in
    the dtype the loaded model computes in (its parameters were cast to it at load)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from pipeline.builder.prefill import serving_dtype

    cache = [KVCache() for _ in layers]
    if start:
        cache = replay(layers, start, serving_dtype(model))
    model(mx.array(tokens[start:end])[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _pairs(fresh: Any, old: Any, start: int, end: int):
    for kind, got, want in (("keys", fresh.keys, old.keys), ("values", fresh.values, old.values)):
        yield kind, got[..., start:end, :].astype(want.dtype), want[..., start:end, :]


def sample_check(model: Any, layers: list[Any], tokens: list[int], done: int) -> str | None:
    """Recompute a short window at token 0 and the one ending at the last reused token, compare
    with the parent's stored K/V within a float tolerance; None when both match, else what
    differs."""
    import mlx.core as mx

    from pipeline.builder.prefill import dtype_name

    rtol, atol = TOLERANCE[dtype_name(layers[0].keys.dtype)]
    for start in sorted({0, max(0, done - WINDOW)}):
        end = min(start + WINDOW, done)
        cache = _recompute(model, layers, tokens, start, end)
        for i, (fresh, old) in enumerate(zip(cache, layers, strict=True)):
            for kind, a, b in _pairs(fresh, old, start, end):
                if not mx.allclose(a, b, rtol=rtol, atol=atol).item():
                    return (
                        f"{SPOT_CHECK_DIFFERS}, tokens {start}-{end} differ from the parent's in layer "
                        f"{i} {kind} beyond float tolerance: altered, or built differently"
                    )
    return None


def sample_windows(done: int) -> str:
    """The windows sample_check recomputes, as the manifest says."""
    starts = sorted({0, max(0, done - WINDOW)})
    return " and ".join(f"{s}-{min(s + WINDOW, done)}" for s in starts)


def chunks_check(
    model: Any, layers: list[Any], tokens: list[int], done: int, step: int
) -> list[int] | str:
    """Recompute the parent's chunk 0 from token 0, and its chunk holding the last reused token
    from its stored earlier positions, in its own chunks of `step` and its own token ids; the
    chunks checked when every K/V byte is the parent's, else what differs. Exact only for a
    parent built from token 0 that stores its compute dtype (the caller checks)."""
    import mlx.core as mx

    checked = sorted({0, (done - 1) // step})
    for index in checked:
        start, end = index * step, min((index + 1) * step, len(tokens))
        cache = _recompute(model, layers, tokens, start, end)
        for i, (fresh, old) in enumerate(zip(cache, layers, strict=True)):
            for kind, a, b in _pairs(fresh, old, start, end):
                if not mx.array_equal(a, b).item():
                    return (
                        f"{SPOT_CHECK_DIFFERS}, chunk {index} (tokens {start}-{end}) differs from the "
                        f"parent's in layer {i} {kind}: altered, or built differently"
                    )
    return checked


__all__ = [
    "SPOT_CHECK_DIFFERS",
    "WINDOW",
    "chunks_check",
    "replay",
    "sample_check",
    "sample_windows",
]
