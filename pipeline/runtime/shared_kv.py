"""Pinned bundles whose opening K/V is equal, byte for byte, hold it once.

An entry that shares keeps a base entry and the number of leading positions taken from it, and
holds only its own tail in the layers that are plain token-indexed K/V (mlx-lm's KVCache and
QuantizedKVCache, by exact class name: a subclass such as ChunkedKVCache, a rotating or a
recurrent layer is held whole). Nothing is assumed: the positions shared are those whose token
ids and K/V bits are equal in every such layer, compared when the entry is made. A hand-out
concatenates the pieces once, with room for the request's next tokens, so mlx-lm's first write
lands in place instead of copying again.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

PLAIN = frozenset({"KVCache", "QuantizedKVCache"})
MIN_SHARED_TOKENS = 16  # shorter common openings (a template's first tokens) are not worth a base
_BITS = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def parts(layer: Any) -> list[mx.array]:
    """A plain layer's arrays in a fixed order: keys then values (each one array, or the
    (packed, scales, biases) of QuantizedKVCache)."""
    k, v = layer.keys, layer.values
    return [
        *(k if isinstance(k, list | tuple) else (k,)),
        *(v if isinstance(v, list | tuple) else (v,)),
    ]


def plain(layer: Any) -> bool:
    """Token-indexed K/V whose arrays cover exactly its offset (no room past it)."""
    if type(layer).__name__ not in PLAIN or getattr(layer, "keys", None) is None:
        return False
    offset = getattr(layer, "offset", None)
    arrays = parts(layer)
    return (
        isinstance(offset, int)
        and len(arrays) % 2 == 0
        and all(isinstance(p, mx.array) and p.ndim >= 2 and p.shape[-2] == offset for p in arrays)
    )


def _bits(x: mx.array) -> mx.array:
    """The array's bits as unsigned integers: equal values with other bits (-0.0, NaNs) differ."""
    unsigned = _BITS.get(x.dtype.size)
    return x.view(unsigned) if unsigned is not None and x.dtype != unsigned else x


def equal_positions(new: Sequence[mx.array], pieces: Sequence[Sequence[mx.array]], n: int) -> int:
    """How many leading positions (at most n) of a layer's arrays `new` are bit-equal to the
    same positions of `pieces` (the base's consecutive runs of that layer's arrays)."""
    start = 0
    for piece in pieces:
        length = min(piece[0].shape[-2], n - start)
        if length <= 0:
            break
        differs = None
        for x, y in zip(new, piece, strict=True):
            a, b = _bits(x[..., start : start + length, :]), _bits(y[..., :length, :])
            d = mx.any(a != b, axis=(*range(a.ndim - 2), a.ndim - 1))
            differs = d if differs is None else differs | d
        differs = differs.tolist()
        if any(differs):
            return start + differs.index(True)
        start += length
    return min(start, n)


def tail(layer: Any, n: int) -> Any:
    """A copy of a plain layer holding its own arrays for positions n.. only (real copies: a view
    would keep the whole loaded buffer alive)."""
    out = copy.copy(layer)
    cut = [mx.contiguous(p[..., n:, :]) for p in parts(layer)]
    _set_parts(out, cut)
    return out


def assemble(template: Any, pieces: Sequence[Sequence[mx.array]], keep: int, room: int) -> Any:
    """A fresh layer like `template` holding `keep` positions from the pieces (in order), with
    `room` zeroed positions after them; its offset is `keep`."""
    out = copy.copy(template)
    columns = list(zip(*pieces, strict=True))
    joined = []
    for column in columns:
        runs = list(column)
        if room:
            first = runs[0]
            runs.append(mx.zeros((*first.shape[:-2], room, first.shape[-1]), first.dtype))
        joined.append(runs[0] if len(runs) == 1 else mx.concatenate(runs, axis=-2))
    _set_parts(out, joined)
    out.offset = keep
    return out


def room_for(layer: Any, tokens: int) -> int:
    """Positions to leave after the kept ones for `tokens` new ones, in the layer's own step."""
    step = getattr(layer, "step", 256)
    step = step if isinstance(step, int) and step > 0 else 256
    return -(-tokens // step) * step if tokens > 0 else 0


def kind(layer: Any) -> tuple | None:
    """What two layers must agree on to exchange positions (None: not plain K/V): class,
    quantization, and each array's dtype and every dimension but the token axis."""
    if not plain(layer):
        return None
    shapes = tuple((p.dtype, p.shape[:-2], p.shape[-1]) for p in parts(layer))
    return (type(layer), getattr(layer, "bits", None), getattr(layer, "group_size", None), shapes)


def pieces(entry: Any, i: int, upto: int) -> list[list[mx.array]]:
    """Layer i's arrays for positions [0, upto) of an entry, as consecutive runs (views): its
    base's for the positions it shares, then its own."""
    if upto <= 0:
        return []
    if entry.base is not None and i in entry.shared_layers:
        n = entry.shared
        out = pieces(entry.base, i, min(upto, n))
        if upto > n:
            out.append([p[..., : upto - n, :] for p in parts(entry.cache[i])])
        return out
    return [[p[..., :upto, :] for p in parts(entry.cache[i])]]


def depth(entry: Any) -> int:
    return 0 if entry.base is None else 1 + depth(entry.base)


def best_base(entry: Any, candidates: Sequence[Any]) -> tuple[Any, int, frozenset[int]] | None:
    """The candidate whose opening the entry can take most positions of (token ids and K/V bits
    equal in every layer they share), those positions and the layers; None below
    MIN_SHARED_TOKENS. Compared in order of common token ids, so usually once."""
    ranked = []
    for cand in candidates:
        common = common_prefix(cand.tokens, entry.tokens)
        layers = frozenset(
            i
            for i, (a, b) in enumerate(zip(entry.kinds, cand.kinds, strict=False))
            if a is not None and a == b
        )
        if common >= MIN_SHARED_TOKENS and layers and len(entry.kinds) == len(cand.kinds):
            ranked.append((-common, depth(cand), id(cand), cand, layers))
    best = None
    for neg_common, _, _, cand, layers in sorted(ranked, key=lambda r: r[:3]):
        n = -neg_common
        if best is not None and n <= best[1]:
            break
        for i in sorted(layers):
            n = equal_positions(parts(entry.cache[i]), pieces(cand, i, n), n)
            if n < MIN_SHARED_TOKENS:
                break
        if n >= MIN_SHARED_TOKENS and (best is None or n > best[1]):
            best = (cand, n, layers)
    return best


def hand_out(entry: Any, keep: int, rest: int, other: Callable[[Any], Any]) -> list:
    """A fresh cache of an entry that shares: `keep` positions assembled from its pieces in the
    shared layers (with room for `rest` more), its other layers as `other(layer)` gives them."""
    out = []
    for i, layer in enumerate(entry.cache):
        if i in entry.shared_layers:
            out.append(assemble(layer, pieces(entry, i, keep), keep, room_for(layer, rest)))
        else:
            out.append(other(layer))
    return out


def held_bytes(entries: Sequence[Any]) -> int:
    """Bytes the entries hold, each array once: an entry's own, and its bases' (transitively)."""
    seen: dict[int, int] = {}
    stack = [e for e in entries if e.cache is not None]
    while stack:
        e = stack.pop()
        if id(e) not in seen:
            seen[id(e)] = e.own_bytes
            if e.base is not None:
                stack.append(e.base)
    return sum(seen.values())


def common_prefix(a: Any, b: Any) -> int:
    """Length of the longest common prefix of two token arrays (NumPy)."""
    import numpy as np

    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _set_parts(layer: Any, arrays: list[mx.array]) -> None:
    half = len(arrays) // 2
    keys, values = arrays[:half], arrays[half:]
    kind = type(layer.keys)
    layer.keys = kind(keys) if kind in (list, tuple) else keys[0]
    layer.values = kind(values) if kind in (list, tuple) else values[0]


__all__ = ["MIN_SHARED_TOKENS", "PLAIN", "best_base", "hand_out", "held_bytes", "kind", "tail"]
