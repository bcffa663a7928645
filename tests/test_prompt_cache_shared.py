"""Mounted bundles whose token prefixes agree hold those positions' K/V once: only where the token
ids and the K/V bits are equal (compared at pin), and a hand-out from a shared entry is the one
from the bundle alone, bit for bit."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from pipeline.runtime import PromptCacheManager, mount
from pipeline.runtime.mount import release_caches

from conftest import SYSTEM, build_bundle, write_definition

PREAMBLE = SYSTEM * 3  # long enough that the tenants' own tails are a small part
TAILS = {"tenant-a": " Reseller A ships to Norway only.", "tenant-b": " Reseller B sells maps."}


def define(root: Path, model: Path, name: str, system: str) -> None:
    """prefixes/<name>.toml: this system text alone (no tools after it: a tenant's own words
    come last, as a reseller paragraph appended to a shared prompt does)."""
    path = write_definition(root, model, name, prefill_step_size=16)
    text = path.read_text().replace(json.dumps(SYSTEM), json.dumps(system))
    path.write_text(text.replace(f'tools_file = "{name}/tools.json"\n', ""))


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """A bundles folder: shop (the preamble) and two tenants built after it (they continue it)."""
    root = tmp_path_factory.mktemp("tenants")
    define(root, tiny_model, "shop", PREAMBLE)
    build_bundle(root, "shop")
    for name, tail in TAILS.items():
        define(root, tiny_model, name, PREAMBLE + tail)
        build_bundle(root, name)
    return root / "bundles"


def bits(x) -> bytes:
    """An array's bits (a tuple's, an int's value), so -0.0 and 0.0 differ."""
    if isinstance(x, list | tuple):
        return b"|".join(bits(p) for p in x)
    if not isinstance(x, mx.array):
        return repr(x).encode()
    unsigned = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32}[x.dtype.size]
    return np.array(x.view(unsigned)).tobytes()


def kept(layer) -> list:
    """A layer's K/V arrays up to its offset (what a request continues from)."""
    return [
        tuple(p[..., : layer.offset, :] for p in part) if isinstance(part, tuple | list)
        else part[..., : layer.offset, :]
        for part in (layer.keys, layer.values)
    ]  # fmt: skip


def same_cache(a: list, b: list) -> bool:
    """Every layer holds the same offset and the same bits up to it."""
    return all(
        type(x) is type(y) and x.offset == y.offset and bits(kept(x)) == bits(kept(y))
        for x, y in zip(a, b, strict=True)
    )


def test_a_preamble_shared_by_bundles_is_held_once(tenants: Path, tiny_model: Path):
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    manager = PromptCacheManager()
    result = mount(tiny_model, tenants, manager=manager, model_key="m")
    release_caches(result)  # as serve does: the manager alone holds them
    gc.collect()
    grown = mx.get_active_memory() - before
    stats = manager.stats()
    assert stats["pinned"] == 3 and all(b.cache == [] for b in result.bundles)
    one = max(b.manifest.cache.nbytes for b in result.bundles)
    # three bundles, each ~95 % preamble: held about one of them, not three
    assert stats["pinned_bytes"] > 2.5 * one
    assert one <= stats["held_bytes"] < 1.3 * one
    assert grown <= 1.2 * stats["held_bytes"], (grown, stats)


def test_a_hand_out_from_a_shared_bundle_is_the_bundle_alone_bit_for_bit(
    tenants: Path, tiny_model: Path
):
    from mlx_lm import load

    model, _ = load(str(tiny_model))
    shared = PromptCacheManager()
    result = mount(tiny_model, tenants, manager=shared, model_key="m")
    assert shared.stats()["held_bytes"] < shared.stats()["pinned_bytes"] / 2
    for b in result.bundles:
        alone = PromptCacheManager()
        mount(tiny_model, [b.path], manager=alone, model_key="m")
        n = len(b.tokens)
        for request in (b.tokens + [5, 6, 7], b.tokens, b.tokens[: n - 9] + [11, 12]):
            x, y = shared.fetch("m", request), alone.fetch("m", request)
            assert (x.cache_hit_tokens, x.remaining, x.source) == (
                y.cache_hit_tokens,
                y.remaining,
                y.source,
            )
            assert same_cache(x.cache, y.cache)
            step = mx.array([x.remaining[:1]])
            lx, ly = model(step, cache=x.cache), model(step, cache=y.cache)
            assert bits(lx) == bits(ly) and same_cache(x.cache, y.cache)


def layers(keys: list[mx.array], values: list[mx.array]) -> list:
    out = []
    for k, v in zip(keys, values, strict=True):
        layer = KVCache()
        layer.update_and_fetch(k, v)
        layer.keys, layer.values = kept(layer)  # exactly offset long, as a bundle loads
        out.append(layer)
    return out


@pytest.mark.parametrize("kind", ["value", "negative zero", "quantized"])
def test_positions_whose_bits_differ_are_not_shared(kind: str):
    """Equal token ids are not enough: the positions shared end where any layer's bits differ
    (a bundle built with another chunking rounds differently; -0.0 == 0.0 but differs)."""
    rng = np.random.default_rng(0)
    shape = (1, 2, 80, 64)
    keys = [mx.array(rng.standard_normal(shape).astype(np.float16)) for _ in range(2)]
    values = [mx.array(rng.standard_normal(shape).astype(np.float16)) for _ in range(2)]
    other_k = [mx.array(np.array(k)) for k in keys]
    if kind == "negative zero":
        edited = np.array(keys[0])
        edited[0, 1, 30, 5] = 0.0
        keys[0] = mx.array(edited)
        edited[0, 1, 30, 5] = -0.0
        other_k[0] = mx.array(edited)
        differs = 30
    else:
        edited = np.array(other_k[1])
        edited[0, 0, 40, 3] += 1
        other_k[1] = mx.array(edited)
        differs = 40
    a = layers([k[..., :60, :] for k in keys], [v[..., :60, :] for v in values])
    b = layers(other_k, values)
    if kind == "quantized":
        a, b = (
            [x.to_quantized(group_size=32, bits=8) for x in a],
            [x.to_quantized(group_size=32, bits=8) for x in b],
        )
    tokens = list(range(80))
    manager = PromptCacheManager()
    manager.pin("m", tokens[:60], a, "a")
    manager.pin("m", tokens, b, "b")
    entry_b = manager._pinned["m"]["b"]
    assert entry_b.base is not None and entry_b.shared == differs
    hit = manager.fetch("m", tokens + [1])
    assert hit.source == "bundle:b" and hit.cache_hit_tokens == 80
    assert same_cache(hit.cache, b)  # the sign bit and the edited value are b's own
    per_token = sum(x.nbytes for x in b) // 80
    assert manager.stats()["held_bytes"] == sum(x.nbytes for x in a) + per_token * (80 - differs)
