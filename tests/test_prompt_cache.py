"""PromptCacheManager: reuse rules, copy-on-write hand-outs and exact logits on real caches."""

import copy
import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama, mamba
from mlx_lm.models.cache import (
    CacheList,
    RotatingKVCache,
    make_prompt_cache,
    trim_prompt_cache,
)

from pipeline.format.errors import PipelineError
from pipeline.runtime.prompt_cache import CacheHit, PromptCacheManager, _arrays

VOCAB = 64
_rng = np.random.default_rng(7)


@pytest.fixture(autouse=True)
def _same_ids_in_any_order():
    global _rng
    _rng = np.random.default_rng(7)


def ids(n: int) -> list[int]:
    """Random token ids, never 0: 0 is kept for 'the request diverges here'."""
    return _rng.integers(1, VOCAB, size=n).tolist()


def llama_model(hidden: int = 32, heads: int = 4) -> llama.Model:
    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=heads,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def model() -> llama.Model:
    return llama_model()


@pytest.fixture(scope="module")
def ssm() -> mamba.Model:
    mx.random.seed(0)
    args = mamba.ModelArgs(
        model_type="mamba",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        state_size=8,
        num_hidden_layers=2,
        conv_kernel=4,
        use_bias=False,
        use_conv_bias=True,
        time_step_rank=4,
    )
    m = mamba.Model(args)
    mx.eval(m.parameters())
    return m


def kv(model):
    return make_prompt_cache(model)


def rotating(model, window: int = 8):
    # keep=0: a one-shot cold prefill masks a plain sliding window, with no attention sinks
    return [RotatingKVCache(max_size=window, keep=0) for _ in model.layers]


def prefill(model, tokens: list[int], cache: list | None = None, make=kv) -> tuple[list, mx.array]:
    """Run tokens through the model; returns the cache and the last position's logits."""
    cache = make(model) if cache is None else cache
    logits = model(mx.array([tokens]), cache=cache)[0, -1]
    mx.eval(logits, list(_arrays(cache)))
    return cache, logits


def assert_fresh(model, hit: CacheHit, tokens: list[int], make=kv) -> mx.array:
    """Logits on `remaining` with the handed-out cache equal a cold full prefill's."""
    assert hit.remaining == tokens[hit.cache_hit_tokens :] and hit.remaining
    _, logits = prefill(model, hit.remaining, hit.cache, make)
    _, cold = prefill(model, tokens, None, make)
    assert logits.dtype == mx.float32
    assert mx.allclose(logits, cold, atol=1e-4).item()
    return logits


def pinned(model, tokens: list[int], name: str = "b", make=kv) -> PromptCacheManager:
    manager = PromptCacheManager()
    manager.pin("m", tokens, prefill(model, tokens, make=make)[0], name)
    return manager


def test_exact_resubmission_leaves_one_token(model):
    prefix = ids(24)
    hit = pinned(model, prefix).fetch("m", prefix)
    assert (hit.cache_hit_tokens, hit.source) == (23, "bundle:b")
    assert_fresh(model, hit, prefix)


def test_extension_reuses_whole_prefix(model):
    prefix, tail = ids(24), ids(5)
    hit = pinned(model, prefix).fetch("m", prefix + tail)
    assert (hit.cache_hit_tokens, hit.remaining) == (24, tail)
    assert_fresh(model, hit, prefix + tail)


def test_divergence_inside_prefix_trims(model):
    prefix = ids(24)
    request = prefix[:10] + [0] + ids(4)
    hit = pinned(model, prefix).fetch("m", request)
    assert hit.cache_hit_tokens == 10
    assert all(layer.offset == 10 for layer in hit.cache)
    assert_fresh(model, hit, request)


@pytest.mark.parametrize("request_", [[0, 5, 6], [7]], ids=["first-token", "single-token"])
def test_no_usable_prefix_is_cold(model, request_):
    manager = pinned(model, [7] + ids(10))
    assert manager.fetch("m", request_) == CacheHit(None, request_, 0, "cold")
    assert manager.fetch("m", []) == CacheHit(None, [], 0, "cold")
    assert (manager.stats()["hits"], manager.stats()["misses"]) == (0, 2)


def test_rotating_past_window_reused_only_on_full_extension(model):
    prefix = ids(24)
    manager = pinned(model, prefix, make=rotating)
    extended = prefix + ids(3)
    hit = manager.fetch("m", extended)
    assert hit.cache_hit_tokens == 24
    assert_fresh(model, hit, extended, make=rotating)
    for request in (prefix, prefix[:10] + [0, 1]):
        assert manager.fetch("m", request).source == "cold"
    # A shorter, still trimmable entry serves what the wrapped bundle cannot.
    manager.store("m", prefix[:6], prefill(model, prefix[:6], make=rotating)[0])
    hit = manager.fetch("m", prefix)
    assert (hit.cache_hit_tokens, hit.source) == (6, "entry")
    assert_fresh(model, hit, prefix, make=rotating)


def test_arrays_cache_reused_only_on_full_extension(ssm):
    prefix = ids(20)
    manager = PromptCacheManager()
    manager.pin("m", prefix, prefill(ssm, prefix)[0], "ssm")
    extended = prefix + ids(4)
    hit = manager.fetch("m", extended)
    assert hit.cache_hit_tokens == 20
    assert_fresh(ssm, hit, extended)
    for request in (prefix, prefix[:10] + [0, 1]):
        assert manager.fetch("m", request).source == "cold"


def test_two_bundles_on_a_common_stem_longer_match_wins(model):
    stem = ids(12)
    short, long = stem + [1] + ids(7), stem + [2] + ids(15)
    manager = PromptCacheManager()
    manager.pin("m", short, prefill(model, short)[0], "short")
    manager.pin("m", long, prefill(model, long)[0], "long")
    cases = [(long + [3], "bundle:long", 28), (short + [3], "bundle:short", 20)]
    cases.append((stem + [0, 3], "bundle:short", 12))  # tie: the one needing less trimming
    for request, source, hit_tokens in cases:
        hit = manager.fetch("m", request)
        assert (hit.source, hit.cache_hit_tokens) == (source, hit_tokens)
        assert_fresh(model, hit, request)


def test_eviction_by_count_is_lru_and_keeps_pinned(model):
    bundle = [0] + ids(15)
    manager = pinned(model, bundle)
    manager.max_entries = 2
    a, b, c = ([n] + ids(7) for n in (1, 2, 3))
    for tokens in (a, b):
        manager.store("m", tokens, prefill(model, tokens)[0])
    assert manager.fetch("m", a + [9]).source == "entry"  # a is now the most recent
    manager.store("m", c, prefill(model, c)[0])
    assert [manager.fetch("m", t + [9]).source for t in (a, b, c)] == ["entry", "cold", "entry"]
    stats = manager.stats()
    assert (stats["entries"], stats["pinned"], stats["evictions"]) == (2, 1, 1)
    assert manager.fetch("m", bundle + [9]).source == "bundle:b"


def test_eviction_by_bytes_keeps_pinned(model):
    entries = [[n] + ids(7) for n in (1, 2, 3)]
    caches = [prefill(model, t)[0] for t in entries]
    size = sum(layer.nbytes for layer in caches[0])
    manager = PromptCacheManager(max_bytes=int(2.5 * size))
    big = [0] + ids(599)
    manager.pin("m", big, prefill(model, big)[0], "big")  # above max_bytes, and kept
    for tokens, cache in zip(entries, caches, strict=True):
        manager.store("m", tokens, cache)
    stats = manager.stats()
    assert (stats["entries"], stats["bytes"], stats["evictions"]) == (2, 2 * size, 1)
    assert stats["pinned"] == 1 and stats["pinned_bytes"] > manager.max_bytes
    assert manager.fetch("m", entries[0] + [9]).source == "cold"
    manager.store("m", big + [1], prefill(model, big + [1])[0])  # alone above max_bytes
    assert manager.stats()["rejected"] == 1 and manager.stats()["entries"] == 2


def test_store_drops_strict_prefixes_of_a_trimmable_entry(model):
    tokens = ids(20)
    manager = PromptCacheManager()
    manager.store("m", tokens[:8], prefill(model, tokens[:8])[0])
    manager.store("m", tokens, prefill(model, tokens)[0])
    assert manager.stats()["entries"] == 1
    hit = manager.fetch("m", tokens[:8] + [0])
    assert (hit.cache_hit_tokens, hit.source) == (8, "entry")
    assert_fresh(model, hit, tokens[:8] + [0])


def test_store_ignores_ids_the_cache_never_saw(model):
    prompt, sampled = ids(12), 5  # mlx_lm's server keys a cache with its last sampled token
    manager = PromptCacheManager()
    manager.store("m", prompt + [sampled], prefill(model, prompt)[0])
    request = prompt + [sampled] + ids(3)
    hit = manager.fetch("m", request)
    assert hit.cache_hit_tokens == 12
    assert_fresh(model, hit, request)


def test_model_keys_isolate_caches(model):
    prefix = ids(16)
    manager = pinned(model, prefix)
    manager.store("m", prefix + [1, 2], prefill(model, prefix + [1, 2])[0])
    assert manager.fetch("other", prefix + [1, 2, 3]).source == "cold"
    assert manager.fetch("m", prefix + [1, 2, 3]).source == "entry"


def snapshot(cache: list) -> list[np.ndarray]:
    return [np.array(a) for a in _arrays(cache)]


def copies(cache: list) -> list[mx.array]:
    return [mx.array(a) for a in _arrays(cache)]  # mx.array(a) copies the data


def assert_unchanged(cache: list, saved: list[np.ndarray], before: list[mx.array]) -> None:
    arrays = list(_arrays(cache))
    assert len(arrays) == len(saved) == len(before)
    for now, kept, old in zip(arrays, saved, before, strict=True):
        assert mx.array_equal(now, old).item()
        assert np.array_equal(np.array(now), kept)


def abuse(model, manager: PromptCacheManager, prefix: list[int], make) -> None:
    """Requests that extend, trim and overwrite the caches they were handed."""
    for request in (prefix + ids(3), prefix[:10] + [0, 1], prefix):
        hit = manager.fetch("m", request)
        if hit.cache is not None:
            prefill(model, hit.remaining, hit.cache, make)
    for array in _arrays(manager.fetch("m", prefix + [2]).cache):
        array[...] = 5.0  # writes into every handle it was given
        mx.eval(array)
    for request in (prefix[:10] + [0], prefix + [1]):
        hit = manager.fetch("m", request)
        if hit.cache is None:
            continue
        for layer in hit.cache:
            if layer.is_trimmable():
                layer.trim(4)
            k = mx.full(layer.keys[..., :1, :].shape, 99.0)
            layer.update_and_fetch(k, k)
            layer.keys[..., :2, :] = -7.0
        mx.eval(list(_arrays(hit.cache)))


def decoded(model, tokens: list[int], make) -> list:
    """A cache as generation leaves it: a prefill, then single-token steps (spare capacity)."""
    cache = prefill(model, tokens[:-2], make=make)[0]
    for token in tokens[-2:]:
        prefill(model, [token], cache, make)
    return cache


def wide_rotating(model):
    return rotating(model, window=64)


@pytest.mark.parametrize("make", [kv, rotating, wide_rotating])
def test_pinned_and_stored_bases_stay_bit_identical(model, make):
    prefix = ids(24)
    base, entry = decoded(model, prefix, make), decoded(model, prefix[:16], make)
    saved, before = snapshot(base + entry), copies(base + entry)
    manager = PromptCacheManager()
    manager.pin("m", prefix, base, "b")
    manager.store("m", prefix[:16], entry)
    owned = manager._pinned["m"]["b"].cache + next(iter(manager._entries.values())).cache
    abuse(model, manager, prefix, make)
    assert_unchanged(base + entry, saved, before)
    assert_unchanged(owned, saved, before)
    assert_fresh(model, manager.fetch("m", prefix + [3]), prefix + [3], make)


def test_cache_list_layers_fork_trim_and_stay_unchanged(model):
    tokens = ids(20)
    cache = [CacheList(*pair) for pair in zip(prefill(model, tokens)[0], kv(model), strict=True)]
    for layer in cache:
        first = layer.caches[0]  # its keys and values (mlx-lm 0.31 has no keys_and_values())
        layer.caches[1].update_and_fetch(
            *(x[..., : first.offset, :] for x in (first.keys, first.values))
        )
    saved, before = snapshot(cache), copies(cache)
    manager = PromptCacheManager()
    manager.pin("m", tokens, cache, "pair")
    hit = manager.fetch("m", tokens[:9] + [0])
    for layer in hit.cache:
        for child in layer.caches:
            assert child.offset == 9 and child.keys.shape[2] == 9
            zero = mx.zeros_like(child.keys[..., :1, :])
            child.update_and_fetch(zero, zero)
    mx.eval(list(_arrays(hit.cache)))
    assert_unchanged(cache, saved, before)


def test_quantized_cache_trims_like_mlx_lm_deepcopy_and_trim():
    model = llama_model(hidden=128, heads=4)  # head_dim 32: one quantization group
    prefix, tail = ids(24), [0] + ids(3)
    base = [c.to_quantized(group_size=32, bits=8) for c in prefill(model, prefix)[0]]
    manager = PromptCacheManager()
    manager.pin("m", prefix, base, "q")
    hit = manager.fetch("m", prefix[:14] + tail)
    assert hit.cache_hit_tokens == 14
    # mlx_lm's LRUPromptCache hands out copy.deepcopy(cache) trimmed in place.
    reference = copy.deepcopy(base)
    trim_prompt_cache(reference, 10)
    logits = prefill(model, tail, hit.cache)[1]
    assert mx.array_equal(logits, prefill(model, tail, reference)[1]).item()
    assert logits.dtype == mx.float32 and not mx.array_equal(logits, prefill(model, tail)[1])


def run_requests(model, manager: PromptCacheManager, requests: list, store: bool) -> list:
    out = []
    for request in requests:
        hit = manager.fetch("m", request)
        cache, logits = prefill(model, hit.remaining, hit.cache)
        if store:
            manager.store("m", request, cache)
        out.append((hit.cache_hit_tokens, np.array(logits)))
    return out


def in_threads(model, manager: PromptCacheManager, requests: list, store: bool) -> list:
    results, errors = [None] * len(requests), []

    def worker(t: int) -> None:
        try:
            results[t] = run_requests(model, manager, requests[t], store)
        except Exception as exc:  # surfaced below
            errors.append(exc)
        finally:
            mx.clear_streams()  # else the process can abort at exit (mlx per-thread streams)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    return results


def test_eight_threads_match_sequential(model):
    stems = [ids(24), ids(16)]
    requests = [[stems[t % 2] + ids(2 + t + i) for i in range(3)] for t in range(8)]
    for t in range(8):
        requests[t][1] = requests[t][1][:12] + [0]  # diverges inside the pinned stem

    def manager() -> PromptCacheManager:
        m = PromptCacheManager(max_entries=4)
        for n, stem in enumerate(stems):
            m.pin("m", stem, prefill(model, stem)[0], str(n))
        return m

    cold = [[np.array(prefill(model, r)[1]) for r in rs] for rs in requests]
    sequential = [run_requests(model, manager(), rs, store=False) for rs in requests]
    concurrent = in_threads(model, manager(), requests, store=False)
    for got, want in zip(concurrent, sequential, strict=True):
        for (hit, logits), (seq_hit, seq_logits) in zip(got, want, strict=True):
            assert hit == seq_hit and np.array_equal(logits, seq_logits)  # same splits: same bits
    shared = manager()
    stored = in_threads(model, shared, requests, store=True)
    for t in range(8):
        for (hit, got), (_, want), ref in zip(stored[t], sequential[t], cold[t], strict=True):
            assert hit >= 12
            assert np.allclose(got, want, atol=1e-4) and np.allclose(got, ref, atol=1e-4)
    stats = shared.stats()
    assert stats["hits"] == 24 and stats["misses"] == 0 and stats["entries"] <= 4


def test_hand_outs_serve_a_forward_on_another_thread(model):
    prefix, cache = ids(20), kv(model)
    model(mx.array([prefix]), cache=cache)  # left lazy: bound to this thread's stream
    manager = PromptCacheManager()
    manager.store("m", prefix, cache)
    request = prefix[:12] + [0, 5]
    hit, logits, errors = manager.fetch("m", request), [], []

    def worker() -> None:
        try:
            logits.append(np.array(prefill(model, hit.remaining, hit.cache)[1]))
        except Exception as exc:  # surfaced below
            errors.append(exc)
        finally:
            mx.clear_streams()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert errors == [] and hit.cache_hit_tokens == 12
    assert np.allclose(logits[0], np.array(prefill(model, request)[1]), atol=1e-4)


def test_pin_refuses_a_cache_longer_than_its_tokens(model):
    cache = prefill(model, ids(10))[0]
    with pytest.raises(PipelineError) as err:
        PromptCacheManager().pin("m", ids(6), cache, "support")
    assert str(err.value) == (
        "bundle support: cache covers 10 tokens but 6 token ids were given; "
        "pass the token ids the cache was built from"
    )
    with pytest.raises(PipelineError, match=r"^bundle x: expected a prompt cache"):
        PromptCacheManager().pin("m", ids(6), [], "x")


def test_a_cache_that_cannot_say_how_many_tokens_it_holds_is_not_stored():
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache

    from pipeline.runtime import PromptCacheManager

    state = ArraysCache(size=1)
    state[0] = mx.zeros((1, 3, 8))  # recurrent state only: no offset to tell 4 ids from 5
    manager = PromptCacheManager()
    manager.store("m", [1, 2, 3, 4, 5], [state])
    assert manager.stats()["entries"] == 0
    assert manager.fetch("m", [1, 2, 3, 4, 5, 6]).cache is None


def test_warm_up_runs_a_step_from_the_longest_bundle_and_leaves_it_untouched(model):
    short, long = ids(12), ids(24)
    manager = pinned(model, short, "short")
    manager.pin("m", long, prefill(model, long)[0], "long")
    before = [mx.array(a) for a in _arrays(manager._pinned["m"]["long"].cache)]
    assert manager.warm_up("m", model) == "bundle:long"
    after = list(_arrays(manager._pinned["m"]["long"].cache))
    assert all(mx.array_equal(a, b).item() for a, b in zip(before, after, strict=True))
    request = long + ids(3)
    assert_fresh(model, manager.fetch("m", request), request)
    assert manager.warm_up("other-model", model) is None


# --- reuse must be worth its error (issue 28) -------------------------------------------------------


def quantized_bundle(model, tokens: list[int]) -> list:
    return [c.to_quantized(group_size=32, bits=8) for c in prefill(model, tokens)[0]]


@pytest.mark.parametrize("shared", [1, 3, 11])
def test_a_lossy_bundle_never_serves_a_short_overlap(shared: int):
    """A request sharing only the opening tokens (a template's) with a quantized bundle, or less
    than half of it, is cold: its answer equals a cold prefill exactly."""
    model = llama_model(hidden=128, heads=4)
    prefix = ids(24)
    manager = PromptCacheManager()
    manager.pin("m", prefix, quantized_bundle(model, prefix), "q")
    request = prefix[:shared] + [0] + ids(5)
    hit = manager.fetch("m", request)
    assert (hit.cache, hit.cache_hit_tokens, hit.source) == (None, 0, "cold")
    assert manager.covered("m", request) == 0  # what fetch would serve, without a copy
    assert manager.fetch("m", prefix[:12] + [0] + ids(2)).cache_hit_tokens == 12  # half: reused


def test_an_exact_bundle_wins_over_a_lossy_one_covering_the_same_tokens():
    model = llama_model(hidden=128, heads=4)
    stem = ids(20)
    exact, lossy = stem + ids(4), stem + ids(4)
    manager = PromptCacheManager()
    manager.pin("m", lossy, quantized_bundle(model, lossy), "lossy")  # pinned first: no tie luck
    manager.pin("m", exact, prefill(model, exact)[0], "exact")
    request = stem + [0] + ids(3)
    hit = manager.fetch("m", request)
    assert (hit.source, hit.cache_hit_tokens) == ("bundle:exact", 20)
    assert manager.covered("m", request) == 20
    assert_fresh(model, hit, request)
    # the lossy one was never handed out: no entry of the server's can descend from it
    assert manager.lossy_floor("m", request) == 0 and manager.lossy_floor("m", [0, 1]) == 0


def test_an_exact_hit_on_a_cache_that_cannot_trim_leaves_a_token(model):
    """What mlx-lm's LRUPromptCache does on A then A (or A minus a token) with a rotating or
    recurrent entry: an exact hit and an empty rest. The guard falls back to a shorter entry."""
    from pipeline.runtime.prompt_cache import at_least_one_left

    a = ids(20)
    full, _ = prefill(model, a, make=lambda m: rotating(m, window=8))
    shorter, _ = prefill(model, a[:-1], make=lambda m: rotating(m, window=8))
    entries = {tuple(a): full, tuple(a[:-1]): shorter}

    def fetch(tokens):  # exact hits only, as the server's trie gives them for these entries
        found = entries.get(tuple(tokens))
        return (copy.deepcopy(found), []) if found is not None else (None, tokens)

    cache, rest = at_least_one_left(fetch, a)
    assert rest == a[-1:] and cache[0].offset == 19
    cache, rest = at_least_one_left(fetch, a[:-1])  # A minus its last token: nothing shorter
    assert (cache, rest) == (None, a[:-1])
    trimmable, _ = prefill(model, a)
    cache, rest = at_least_one_left(lambda t: (copy.deepcopy(trimmable), []), a)
    assert rest == a[-1:] and cache[0].offset == 19


def test_the_lossy_floor_outlives_a_remount_that_removes_the_lossy_bundle():
    """An entry the server stored after reusing a 4-bit bundle stays held to that bundle's rule
    when a remount replaces it by a full-precision version or removes it (the floor was computed
    from what was pinned now: the unpin laundered the entry)."""
    model = llama_model(hidden=128, heads=4)
    prefix = ids(24)
    manager = PromptCacheManager()
    manager.pin("m", prefix, quantized_bundle(model, prefix), "v1")
    request = prefix[:3] + [0] + ids(5)  # shares the template's opening only
    assert manager.lossy_floor("m", request) == 0  # no request took v1 yet: nothing descends
    assert manager.fetch("m", prefix + [7]).source == "bundle:v1"  # now one did
    assert manager.lossy_floor("m", request) == 12
    manager.unpin("m", "v1")  # remount: v1 removed (or replaced by an exact v2)
    manager.pin("m", prefix, prefill(model, prefix)[0], "v2")
    assert manager.lossy_floor("m", request) == 12
    assert manager.lossy_floor("m", [99, 98]) == 0  # an unrelated opening has no floor


def test_an_own_entry_holding_quantized_kv_is_never_the_start_of_an_unrelated_prompt():
    model = llama_model(hidden=128, heads=4)
    prefix = ids(24)
    manager = PromptCacheManager()
    own = quantized_bundle(model, prefix)
    assert manager.lossy_floor("m", [99, 98], own) == 1  # length unknown: at least a token
    assert manager.lossy_floor("m", [99, 98], own, own_tokens=24) == 12
    assert manager.lossy_floor("m", [99, 98], prefill(model, prefix)[0], own_tokens=24) == 0


def test_omni_pool_entries_holding_4_bit_kv_serve_only_their_share():
    """mlx-omni-server hands out its best pool entry trimmed even to 0 tokens, and the prompt is
    then prefilled into its quantized layers: the hook hides such an entry from omni's own
    checkout unless the prompt takes its share (pipeline.runtime.servers.mlx_omni.pool.entry_usable)."""
    from types import SimpleNamespace

    from pipeline.runtime.servers.mlx_omni.pool import entry_usable

    model = llama_model(hidden=128, heads=4)
    prefix = ids(24)
    mounted = SimpleNamespace(manager=PromptCacheManager())
    lossy = SimpleNamespace(tokens=prefix, cache=quantized_bundle(model, prefix))
    exact = SimpleNamespace(tokens=prefix, cache=prefill(model, prefix)[0])
    other_system = prefix[:3] + [0] + ids(5)
    assert not entry_usable(mounted, lossy, other_system)
    assert not entry_usable(mounted, lossy, [99, 98])  # user-only: omni would trim it to 0
    assert entry_usable(mounted, lossy, prefix[:12] + [0])  # half of it: the rule allows
    assert entry_usable(mounted, exact, other_system)
    # an exact entry continued from a 4-bit bundle: held by that bundle's rule, also after it
    mounted.manager.pin("bundles", prefix, quantized_bundle(model, prefix), "q")
    assert entry_usable(mounted, exact, other_system)  # no request took it: no descendants
    mounted.manager.fetch("bundles", prefix + [0])  # a request continues it
    mounted.manager.unpin("bundles", "q")
    assert not entry_usable(mounted, exact, other_system)


@pytest.mark.parametrize(
    ("tokens", "said"),
    [
        ([[1, 2, 3], [1, 2, 3]], "one list of whole numbers, got a 2-D array"),
        ([1.5, 2.7, 3.0], "got a 1-D array of float64"),
        ([True, False], "got a 1-D array of bool"),
        (np.array([2**63 + 5, 1], dtype=np.uint64), "is past what a token id can be"),
        ([1, 2**70], "got a 1-D array of object"),
        ([[1, 2], [3]], "must be a list of whole numbers"),
        ("abc", "got a 0-D array"),
    ],
    ids=["a batch", "floats", "bools", "uint64 past int64", "past int64", "ragged", "a string"],
)
def test_token_ids_that_are_not_one_prompt_are_refused_not_reshaped(model, tokens, said):
    """A batch was flattened into one prompt, floats truncated, big unsigned ids wrapped: each
    looked up another prompt than the one asked for. Now one error naming what was given."""
    manager = pinned(model, ids(24))
    for call in (manager.fetch, manager.covered):
        with pytest.raises(PipelineError, match=said):
            call("m", tokens)


def test_a_path_and_its_string_name_the_same_model(model, tmp_path):
    """mount() pins under str(model_dir); a server asking with the Path (or a trailing slash)
    was cold on every request."""
    from pathlib import Path

    prefix = ids(24)
    manager = PromptCacheManager()
    cache, _ = prefill(model, prefix)
    manager.pin(str(tmp_path / "m"), prefix, cache, "b")
    for key in (tmp_path / "m", f"{tmp_path}/m/", Path(f"{tmp_path}/m")):
        assert manager.fetch(key, [*prefix, 1]).cache_hit_tokens == 24
    with pytest.raises(PipelineError, match="model key must be a str or a path, got int"):
        manager.fetch(3, prefix)


def test_fork_cache_refuses_a_negative_trim(model):
    """A negative trim made a cache whose offset ran past its keys (silently broken attention)."""
    from pipeline.runtime.prompt_cache import fork_cache

    cache, _ = prefill(model, ids(24))
    with pytest.raises(PipelineError, match="trim must be 0 or more tokens, got -3"):
        fork_cache(cache, -3)
