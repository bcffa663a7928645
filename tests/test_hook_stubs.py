"""Fast tests of a hook's cache subclass without the server's venv (issue 37): a stub shaped like
the server's own cache class stands in for it, and the subclass must hand out a bundle, leave at
least one token, hold the server's own lossy entries to the rule (also after a remount), keep
nothing while warming up and report usage. A slow test checks each stub against the installed
server's class (the methods and parameters the hook relies on), so a stub cannot drift."""

from __future__ import annotations

import copy
import inspect
import json
import logging
import subprocess
from collections import OrderedDict, deque
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_prompt_cache import ids, llama_model, prefill, quantized_bundle

from pipeline.runtime.prompt_cache import PromptCacheManager
from pipeline.runtime.servers import usage, warm_up
from pipeline.runtime.servers.memory_cache import (
    install_memory_cache,
    memory_entries,
    pinned_memory_cache_class,
)
from pipeline.runtime.servers.mounted import BUNDLE_KEY, Mounted


class StubMemoryAwarePrefixCache:
    """vllm-mlx's / rapid-mlx's MemoryAwarePrefixCache as the hook uses it: whole-sequence keys,
    `fetch(tokens) -> (cache or None, rest)` by longest stored prefix, `store(tokens, cache)`,
    its entries in `_entries` (least recently used first) as `_CacheEntry(tokens, cache)`."""

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[int, ...], SimpleNamespace] = OrderedDict()
        self._last_match_type, self._last_matched_key = None, None

    def fetch(self, tokens: list[int]) -> tuple[list | None, list[int]]:
        if tuple(tokens) in self._entries:  # an exact hit: the stored state itself, nothing left
            return self._entries[tuple(tokens)].cache, []
        keys = [k for k in self._entries if tuple(tokens[: len(k)]) == k and len(k) < len(tokens)]
        if not keys:
            return None, list(tokens)
        best = max(keys, key=len)
        self._entries.move_to_end(best)
        self._last_matched_key = best
        return self._entries[best].cache, list(tokens[len(best) :])

    def store(self, tokens: list[int], cache: list) -> bool:
        self._entries[tuple(tokens)] = SimpleNamespace(tokens=tuple(tokens), cache=cache)
        return True

    def clear(self) -> None:
        self._entries.clear()


class StubScheduler:
    """Their Scheduler as far as the hook uses it: deep_reset (the engine's stop) clears the
    memory-aware cache."""

    def __init__(self, cache: StubMemoryAwarePrefixCache) -> None:
        self.memory_aware_cache = cache

    def deep_reset(self) -> None:
        self.memory_aware_cache.clear()


@pytest.fixture
def pinned_cache():
    """The hook's subclass of the stub, over a manager with one full-precision bundle pinned."""
    model = llama_model(hidden=128, heads=4)
    prefix = ids(24)
    manager = PromptCacheManager()
    manager.pin(BUNDLE_KEY, prefix, prefill(model, prefix)[0], "shop@1")
    mounted = Mounted(Path("model"), manager, SimpleNamespace(bundles=[]))
    cls = pinned_memory_cache_class(mounted, StubMemoryAwarePrefixCache, "stub")
    return SimpleNamespace(cache=cls(), prefix=prefix, model=model, manager=manager)


def served(result: tuple, tokens: list[int]) -> int:
    cache, rest = result
    return 0 if cache is None else len(tokens) - len(rest)


def test_it_hands_out_the_bundle_and_reports_usage(pinned_cache):
    request = [*pinned_cache.prefix, 7, 8]
    usage._worker.reuse = reuse = usage.Reuse()
    try:
        result = pinned_cache.cache.fetch(request)
    finally:
        usage._worker.reuse = None
    assert served(result, request) == len(pinned_cache.prefix)
    assert (reuse.cached, reuse.looked_up) == (len(pinned_cache.prefix), True)
    assert pinned_cache.cache._last_match_type == "prefix"


def test_an_exact_hit_on_its_own_entry_leaves_a_token_and_the_entry_whole(pinned_cache):
    """vllm-mlx's and rapid-mlx's fetch hand out the stored state itself on an exact hit: the
    token left to process is cut from a copy, never from the entry (a second identical request
    would otherwise continue from a cache one token shorter than its key says)."""
    request = [*pinned_cache.prefix, *ids(6)]
    pinned_cache.cache.store(request, prefill(pinned_cache.model, request)[0])
    for _ in range(3):
        cache, rest = pinned_cache.cache.fetch(list(request))
        assert rest == request[-1:] and {layer.offset for layer in cache} == {len(request) - 1}
    stored = pinned_cache.cache._entries[tuple(request)].cache
    assert {layer.offset for layer in stored} == {len(request)}


def test_an_exact_hit_leaves_a_token(pinned_cache):
    request = list(pinned_cache.prefix)
    cache, rest = pinned_cache.cache.fetch(request)
    assert cache is not None and len(rest) >= 1


def test_its_own_lossy_entry_is_held_to_the_rule_also_after_a_remount(pinned_cache):
    """An entry continued from a 4-bit bundle, kept by the server: a request sharing only the
    opening tokens is not served from it, while the bundle is pinned and after it is gone."""
    lossy = ids(30)
    pinned_cache.manager.pin(BUNDLE_KEY, lossy, quantized_bundle(pinned_cache.model, lossy), "q@1")
    pinned_cache.cache.store(lossy, quantized_bundle(pinned_cache.model, lossy))
    opening = [*lossy[:3], 99, 98]
    assert served(pinned_cache.cache.fetch(opening), opening) == 0
    pinned_cache.manager.unpin(BUNDLE_KEY, "q@1")  # a remount removed it
    assert served(pinned_cache.cache.fetch(opening), opening) == 0
    whole = [*lossy, 99]
    assert served(pinned_cache.cache.fetch(whole), whole) == len(lossy)  # its share: allowed


def test_nothing_is_stored_while_warming_up(pinned_cache):
    warm_up.WARMING.set()
    try:
        assert pinned_cache.cache.store([1, 2, 3], []) is False
    finally:
        warm_up.WARMING.clear()
    assert pinned_cache.cache._entries == {}


# --- --snapshots through the memory-aware cache (pipeline.runtime.snapshots) ------------------------

EXACT = [(5 * i + 1) % 900 + 10 for i in range(120)]
LOSSY = [(11 * i + 7) % 900 + 10 for i in range(200)]


class _QuantizedCacheWrapper:
    """vllm-mlx's quantized entry layer (vllm_mlx.memory_cache): mx.quantize's triples."""

    def __init__(self, layer, bits: int = 8, group_size: int = 64) -> None:
        import mlx.core as mx

        n = layer.offset
        self.keys = mx.quantize(layer.keys[..., :n, :], group_size=group_size, bits=bits)
        self.values = mx.quantize(layer.values[..., :n, :], group_size=group_size, bits=bits)
        self.offset, self.bits, self.group_size = n, bits, group_size
        self.orig_type = type(layer)  # and, as vllm-mlx's, what it keeps of the original layer
        self.orig_attrs = {
            a: getattr(layer, a) for a in ("max_size", "keep", "step", "_idx") if hasattr(layer, a)
        }


class StubQuantizingPrefixCache(StubMemoryAwarePrefixCache):
    """vllm-mlx's MemoryAwarePrefixCache under --kv-cache-quantization: entries stored as
    `_QuantizedCacheWrapper` layers, handed out dequantized (full-precision KVCache objects),
    matched by longest common prefix (trimmed to it), the match's key in `_last_matched_key`."""

    def __init__(self) -> None:
        super().__init__()
        # vllm-mlx counts each fetch in `_stats` (hits, misses, tokens saved: its /v1/status)
        self._stats = SimpleNamespace(hits=0, misses=0, tokens_saved=0)

    def store(self, tokens: list[int], cache: list) -> bool:
        return super().store(tokens, [_QuantizedCacheWrapper(layer, 8, 32) for layer in cache])

    def fetch(self, tokens: list[int]) -> tuple[list | None, list[int]]:
        found = self._fetch(tokens)
        if found[0] is None:
            self._stats.misses += 1
        else:
            self._stats.hits += 1
            self._stats.tokens_saved += len(tokens) - len(found[1])
        return found

    def _fetch(self, tokens: list[int]) -> tuple[list | None, list[int]]:
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache

        def shared(key: tuple[int, ...]) -> int:
            return next(
                (i for i, (a, b) in enumerate(zip(key, tokens, strict=False)) if a != b),
                min(len(key), len(tokens)),
            )

        best = max(self._entries, key=shared, default=None)
        if best is None or shared(best) == 0:
            return None, list(tokens)
        self._last_matched_key = best
        layers = []
        for w in self._entries[best].cache:
            layer = KVCache()
            keys = mx.dequantize(*w.keys, group_size=w.group_size, bits=w.bits)
            values = mx.dequantize(*w.values, group_size=w.group_size, bits=w.bits)
            layer.update_and_fetch(keys, values)
            layer.trim(len(best) - shared(best))
            layers.append(layer)
        return layers, list(tokens[shared(best) :])


class StubRapidQuantizingPrefixCache(StubQuantizingPrefixCache):
    """rapid-mlx's the same way, naming no matched key (its hit is moved last)."""

    def fetch(self, tokens: list[int]) -> tuple[list | None, list[int]]:
        found = super().fetch(tokens)
        if found[0] is not None:
            self._entries.move_to_end(self._last_matched_key)
        del self._last_matched_key
        return found


@pytest.mark.parametrize("base", [StubQuantizingPrefixCache, StubRapidQuantizingPrefixCache])
def test_its_own_quantized_entry_handed_out_dequantized_is_held_to_the_rule(pinned_cache, base):
    """vllm-mlx and rapid-mlx --kv-cache-quantization hand their own 8-bit entries out as
    full-precision KVCache objects: the lookup must still see them as lossy, so a request sharing
    only the opening tokens is not served from one, nor one taking half of it less the token an
    exact hit leaves, while one taking its share is."""
    mounted = Mounted(Path("model"), pinned_cache.manager, SimpleNamespace(bundles=[]))
    cache = pinned_memory_cache_class(mounted, base, "stub")()
    entry = ids(40)
    cache.store(entry, prefill(pinned_cache.model, entry)[0])
    cache.store(ids(8), prefill(pinned_cache.model, ids(8))[0])  # another entry, stored last
    opening = [*entry[:3], 99, 98]
    assert served(cache.fetch(opening), opening) == 0
    # its own counters say what the request got: a miss (they counted a 3-token hit)
    assert (cache._stats.hits, cache._stats.tokens_saved, cache._stats.misses) == (0, 0, 1)
    half = entry[:20]  # a supersequence hit, handed out one token short: 19 of 40
    assert served(cache.fetch(half), half) == 0
    whole = [*entry, 99]
    assert served(cache.fetch(whole), whole) == len(entry)


@pytest.fixture(scope="module")
def tiny_prefill(tiny_model):
    """The tiny model's prompt cache after some tokens (loaded once)."""
    from mlx_lm import load

    model, _ = load(str(tiny_model))
    return lambda tokens: prefill(model, tokens)[0]


@pytest.fixture
def shelf(tmp_path, tiny_model, tiny_prefill, monkeypatch):
    """Snapshots of the tiny model written and restored by serve's code: EXACT, and LOSSY recorded
    lossy (continued from a 4-bit bundle); the memory-aware cache subclass answering from them."""
    from pipeline.runtime.snapshot_store import Entry
    from pipeline.runtime.snapshots import DEFAULT_BUDGET, Snapshots

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    writer = Snapshots(tmp_path / "snaps", DEFAULT_BUDGET, tiny_model, None, "rapid-mlx")
    entries = [
        Entry(EXACT, tiny_prefill(EXACT), "t", False),
        Entry(LOSSY, tiny_prefill(LOSSY), "t", True),
    ]
    writer.save(list(enumerate(entries)), lambda t: 0)
    writer.close()
    snaps = Snapshots(tmp_path / "snaps", DEFAULT_BUDGET, tiny_model, None, "rapid-mlx")
    snaps.restore([])
    manager = PromptCacheManager()
    mounted = Mounted(tiny_model, manager, SimpleNamespace(bundles=[]))
    scheduler = SimpleNamespace(  # the engine's scheduler module, its Scheduler patched
        MemoryAwarePrefixCache=StubMemoryAwarePrefixCache,
        Scheduler=type("Scheduler", (StubScheduler,), {}),
    )
    cls = install_memory_cache(scheduler, mounted, "stub", snaps)
    yield SimpleNamespace(
        cls=cls, cache=cls(), snaps=snaps, mounted=mounted, prefill=tiny_prefill,
        scheduler=scheduler.Scheduler,
    )  # fmt: skip
    snaps.close()


def test_the_memory_cache_answers_from_restored_snapshots_under_the_rule(shelf):
    c = shelf.cache
    usage._worker.reuse = reuse = usage.Reuse()
    try:
        assert served(c.fetch([*EXACT, 1, 2]), [*EXACT, 1, 2]) == len(EXACT)
    finally:
        usage._worker.reuse = None
    assert reuse.cached == len(EXACT)
    assert (c._last_match_type, c._last_matched_key) == ("prefix", None)  # no entry of its own
    assert served(c.fetch(list(EXACT)), EXACT) == len(EXACT) - 1  # always a token left
    # the lossy snapshot serves only its share (half of it), never a short overlap
    assert served(c.fetch([*LOSSY[:60], 1, 2]), [*LOSSY[:60], 1, 2]) == 0
    assert served(c.fetch([*LOSSY[:150], 1]), [*LOSSY[:150], 1]) == 150
    # the server's own entry sharing its opening with the lossy snapshot is held to its rule
    c.store(LOSSY[:40], shelf.prefill(LOSSY[:40]))
    assert served(c.fetch([*LOSSY[:40], 3, 4]), [*LOSSY[:40], 3, 4]) == 0
    c.store([*EXACT[:10], 77], shelf.prefill([*EXACT[:10], 77]))  # its own longer entry wins
    assert served(c.fetch([*EXACT[:10], 77, 5]), [*EXACT[:10], 77, 5]) == 11


@pytest.mark.parametrize("bundle, by", [(len(EXACT), "bundle shop@1"), (60, "request: snapshot")])
def test_a_restored_snapshot_never_beats_an_exact_bundle(shelf, caplog, bundle: int, by: str):
    """A bundle covering as much as the snapshot serves the request (a tie goes to it); one
    covering less gives way to the snapshot."""
    shelf.mounted.manager.pin(BUNDLE_KEY, EXACT[:bundle], shelf.prefill(EXACT[:bundle]), "shop@1")
    with caplog.at_level(logging.INFO, logger="prefix-bundles"):
        assert served(shelf.cache.fetch([*EXACT, 1]), [*EXACT, 1]) == len(EXACT)
    lines = [r.getMessage() for r in caplog.records if "request:" in r.getMessage()]
    assert any(by in line for line in lines), lines
    if by.startswith("bundle"):
        assert not any("request: snapshot" in line for line in lines), lines


def test_the_memory_cache_lists_what_it_held_at_the_engines_stop(shelf, tmp_path, tiny_model):
    """The scheduler's deep_reset (its engine's stop) clears the cache before serve saves: what
    it held then is listed, cut to its KV, quantized and continued-from-lossy entries recorded
    lossy, hottest last stored; saved and restored, the set answers as the entries did."""
    from pipeline.runtime.snapshots import DEFAULT_BUDGET, Snapshots

    c = shelf.cache
    plain = [*EXACT[:30], 5, 6, 7]
    c.store([*plain, 8], shelf.prefill(plain))  # prompt + output: the last token never fed
    quantized = [(13 * i + 3) % 900 + 10 for i in range(20)]  # opens like no other entry
    c.store(quantized, [_QuantizedCacheWrapper(layer) for layer in shelf.prefill(quantized)])
    descends = [*LOSSY[:130], 4, 4]  # continued from the lossy snapshot a request took
    assert shelf.snaps.fetch(descends, better_than=0)[1] == 130
    c.store(descends, shelf.prefill(descends))
    shelf.scheduler(c).deep_reset()
    assert c._entries == {}
    listed = memory_entries(shelf.cls, shelf.mounted, shelf.snaps, "stub")
    by_tokens = {tuple(e.tokens): (stamp, e) for stamp, e in listed}
    assert set(by_tokens) == {tuple(plain), tuple(quantized), tuple(descends)}
    assert [by_tokens[tuple(t)][1].lossy for t in (plain, quantized, descends)] == [0, 1, 1]
    assert by_tokens[tuple(quantized)][1].cache[0].__class__.__name__ == "QuantizedKVCache"
    stamps = [by_tokens[tuple(t)][0] for t in (plain, quantized, descends)]
    assert stamps == sorted(stamps) and stamps[0] > 0
    shelf.snaps.save(listed, lambda t: 0)
    shelf.snaps.close()
    again = Snapshots(tmp_path / "snaps", DEFAULT_BUDGET, tiny_model, None, "rapid-mlx")
    again.restore([])
    try:
        assert again.fetch([*plain, 1], better_than=0)[1] == len(plain)
        assert again.fetch([*quantized[:4], 1], better_than=0)[0] is None  # lossy: its share
        assert again.fetch([*quantized, 1], better_than=0)[1] == len(quantized)
    finally:
        again.close()


STUBS = {"MemoryAwarePrefixCache": StubMemoryAwarePrefixCache}
INSTALLED = {  # (venv python, module) of the real class each stub stands in for
    "vllm-mlx": ("servers_python", "vllm_mlx.memory_cache"),
    "rapid-mlx": ("rapid_python", "rapid_mlx.memory_cache"),
}


@pytest.mark.slow
@pytest.mark.parametrize("server", sorted(INSTALLED))
def test_each_stub_has_the_methods_and_parameters_of_the_installed_class(server: str):
    import servers_env

    python_of, module = INSTALLED[server]
    python = getattr(servers_env, python_of)()
    code = (
        "import importlib, inspect, json, sys\n"
        f"m = importlib.import_module({module!r})\n"
        "c = m.MemoryAwarePrefixCache\n"
        "print(json.dumps({n: list(inspect.signature(getattr(c, n)).parameters) "
        "for n in ('fetch', 'store')}))\n"
    )
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    real = json.loads(done.stdout.strip().splitlines()[-1])
    stub = StubMemoryAwarePrefixCache
    assert real["fetch"][:2] == list(inspect.signature(stub.fetch).parameters)
    assert real["store"][:3] == list(inspect.signature(stub.store).parameters)


def test_mlx_openai_servers_handler_mounts_only_what_serve_validated(
    shop_bundle, tiny_model, caplog
):
    """mlx-openai-server's handler process mounts the bundles again: one that changed after serve
    validated and logged it is not served there (what serve reported is what is served)."""
    import logging

    from pipeline.runtime import mount
    from pipeline.runtime.servers.mlx_openai.handover import keep_validated, validated
    from pipeline.runtime.servers.mounted import Mounted

    manager = PromptCacheManager()
    result = mount(tiny_model, [shop_bundle], manager=manager, model_key=BUNDLE_KEY)
    mounted = Mounted(tiny_model, manager, result)
    request = [*result.bundles[0].tokens, 1]
    keep_validated(mounted, validated(mounted), "the handler process")
    assert manager.covered(BUNDLE_KEY, request) > 0
    with caplog.at_level(logging.WARNING, logger="prefix-bundles"):
        keep_validated(mounted, {str(shop_bundle): "0" * 64}, "the handler")
    assert mounted.result.bundles == [] and manager.covered(BUNDLE_KEY, request) == 0
    assert "changed after serve validated it" in caplog.text


# --- vllm-mlx's SimpleEngine trie: serve's PinnedTrie over mlx-lm's own LRUPromptCache ------------


@pytest.fixture
def trie():
    """vllm-mlx's pinned trie (mlx-lm's LRUPromptCache, installed here too) with one bundle."""
    from pipeline.runtime.servers.vllm_mlx.simple_engine import pinned_trie_class

    model = llama_model(hidden=128, heads=4)
    prefix = ids(24)
    manager = PromptCacheManager()
    manager.pin(BUNDLE_KEY, prefix, prefill(model, prefix)[0], "shop@1")
    mounted = Mounted(Path("model"), manager, SimpleNamespace(bundles=[object()]))
    cls = pinned_trie_class(mounted)
    made = cls(8)
    made.keep_entries = True  # as under --prefix-trie-cache
    return SimpleNamespace(trie=made, prefix=prefix, model=model, manager=manager)


def test_the_vllm_trie_hands_out_the_bundle_leaves_a_token_and_reports_usage(trie):
    request = [*trie.prefix, 5]
    usage._worker.reuse = reuse = usage.Reuse()
    try:
        cache, rest = trie.trie.fetch_nearest_cache({"model": 1}, request)
    finally:
        usage._worker.reuse = None
    assert cache is not None and rest == [5] and reuse.cached == len(trie.prefix)
    assert reuse.prompt == len(request)  # for the usage fields of a stream's message_start
    cache, rest = trie.trie.fetch_nearest_cache({"model": 1}, list(trie.prefix))
    assert cache is not None and len(rest) >= 1  # an exact hit leaves a token
    # vllm-mlx skips an empty trie on a system snapshot hit: never empty, so its peek (bundles,
    # snapshots, the prompt's length for usage) runs on every request, with or without bundles
    empty = type(trie.trie)(8)
    assert len(empty) == 1 and len(trie.trie) == 1


def test_the_vllm_trie_gives_way_to_vllm_mlx_own_system_snapshot(trie):
    """A bundle well short of the request's system prefix is declined (vllm-mlx then stores its
    own snapshot of that prefix); one that ends a few tokens short of it is used."""
    long_system = [*trie.prefix[:4], *ids(60)]
    request = [*long_system, 7, 8]
    usage._worker.reuse = reuse = usage.Reuse(system_ids=long_system)
    try:
        cache, rest = trie.trie.fetch_nearest_cache({"model": 1}, request)
    finally:
        usage._worker.reuse = None
    assert cache is None and rest == request and reuse.cached == 0
    near = [*trie.prefix, 3, 4]  # the bundle ends 2 tokens short of this system prefix
    usage._worker.reuse = usage.Reuse(system_ids=near)
    try:
        cache, rest = trie.trie.fetch_nearest_cache({"model": 1}, [*near, 9])
    finally:
        usage._worker.reuse = None
    assert cache is not None and len(rest) == 3


def test_the_vllm_trie_stores_nothing_while_warming(trie):
    warm_up.WARMING.set()
    try:
        trie.trie.insert_cache({"model": 1}, [1, 2, 3], prefill(trie.model, [1, 2, 3])[0])
    finally:
        warm_up.WARMING.clear()
    stored = lambda: super(type(trie.trie), trie.trie).__len__()  # noqa: E731 - its own entries
    assert stored() == 0
    trie.trie.insert_cache({"model": 1}, [1, 2, 3], prefill(trie.model, [1, 2, 3])[0])
    assert stored() == 1  # outside the warm-up it keeps entries (--prefix-trie-cache)


# --- every other cache class a hook subclasses: one contract, one adapter per server ---------------
# mlx_lm.server's LRUPromptCache is mlx-lm's own (installed here: the real class); omni's pool and
# mlx-openai-server's LRU copy are stubs shaped like theirs (checked against the installed classes
# by the slow test below), put where the hook imports them from.


class StubPromptCache:
    """omni's PromptCache (mlx_omni_server.chat.mlx.prompt_cache): tokens, cache, model_key."""

    def __init__(self, tokens=None, cache=None, model_key: str = "") -> None:
        self.tokens, self.cache, self.model_key = list(tokens or []), list(cache or []), model_key


def stub_common_prefix_len(list1, list2) -> int:
    n = min(len(list1), len(list2))
    return next((i for i in range(n) if list1[i] != list2[i]), n)


class StubPromptCachePool:
    """omni's PromptCachePool: a list of entries (`.cache`), longest common prefix checkout
    (the entry itself: omni trims a copy of it to the shared prefix), put_cache appends."""

    def __init__(self, max_size: int = 8, ttl_seconds: float = 300.0) -> None:
        self._entries: list = []

    def get_cache(self, prompt_tokens, model_key):
        self._evict_expired()
        best = max(
            (e for e in self._entries if e.cache.model_key == model_key),
            key=lambda e: stub_common_prefix_len(e.cache.tokens, prompt_tokens),
            default=None,
        )
        return best.cache if best is not None else StubPromptCache(model_key=model_key)

    def put_cache(self, cache) -> None:
        self._entries.append(SimpleNamespace(cache=cache))

    def _evict_expired(self) -> None:
        pass


class StubOpenAILRU:
    """mlx-openai-server's LRUPromptCache (app.utils.prompt_cache), a disk-backed copy of mlx-lm's
    without the model argument: tokens per cache type in `_lru._lrus`, an entry per tokens in
    `_trie`, each hit a new copy read back (`_load_cache_from_disk`); an exact hit is the whole
    entry with nothing left, a longer entry is trimmed, else the longest stored prefix."""

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63, cache_dir=None) -> None:
        # an entry is its key here; search as its PromptTrie's (exact, shorter, longer, shared)
        self._trie = SimpleNamespace(get=lambda tokens: tuple(tokens), search=self._search)
        self._lru = SimpleNamespace(_lrus={t: deque() for t in ("assistant", "user", "system")})
        self._stored: dict[tuple[int, ...], list] = {}

    def _load_cache_from_disk(self, entry) -> list:
        return copy.deepcopy(self._stored[entry])  # a new copy, as unpickling gives

    def _search(self, tokens) -> SimpleNamespace:
        exact = tuple(tokens) if tuple(tokens) in self._stored else None
        shared = {k: stub_common_prefix_len(k, tokens) for k in self._stored}
        shorter = max(
            (k for k in shared if shared[k] == len(k) != len(tokens)), key=len, default=None
        )
        longer = max((k for k in shared if shared[k] < len(k)), key=shared.get, default=None)
        common = shared[longer] if longer is not None else 0
        return SimpleNamespace(exact=exact, shorter=shorter, longer=longer, common_prefix=common)

    def fetch_nearest_cache(self, tokens_ids, *, allowed_sources=None):
        found = self._search(tokens_ids)
        if found.exact is not None:
            return self._load_cache_from_disk(found.exact), []
        shorter, longer, shared = found.shorter or (), found.longer, found.common_prefix
        if longer is not None and shared > len(shorter):
            cache, keep = self._load_cache_from_disk(longer), min(len(tokens_ids) - 1, shared)
            for layer in cache:
                layer.trim(len(longer) - keep)
            return cache, list(tokens_ids[keep:])
        if shorter:
            return self._load_cache_from_disk(shorter), list(tokens_ids[len(shorter) :])
        return None, list(tokens_ids)

    def insert_cache(self, tokens_ids, prompt_cache, *, cache_type="assistant", source="nonbatch"):
        self._stored[tuple(tokens_ids)] = prompt_cache
        self._lru._lrus[cache_type].append(tuple(tokens_ids))

    def clear(self) -> None:
        self._stored.clear()
        for lru in self._lru._lrus.values():
            lru.clear()

    def close(self) -> None:
        self.clear()

    def __len__(self) -> int:
        return len(self._stored)


def covered_by(cache, rest, tokens) -> int:
    return 0 if cache is None else len(tokens) - len(rest)


def mlx_lm_adapter(mounted):
    """mlx_lm.server's BundledPromptCache over mlx-lm's real LRUPromptCache."""
    from pipeline.runtime.servers.mlx_lm import bundled_prompt_cache_class

    cache = bundled_prompt_cache_class(mounted, "m")(10)
    key = ("m", None, None)
    return SimpleNamespace(
        store=lambda t, c: cache.insert_cache(key, t, c),
        fetch=lambda t: covered_by(*cache.fetch_nearest_cache(key, t), t),
        warm_store=None,  # its warm-up runs beside the request path (manager.warm_up)
    )


def omni_adapter(mounted, monkeypatch, snapshots=None):
    """omni's PinnedPromptCachePool over the pool stub (a checkout's tokens: what it serves)."""
    import sys
    import types

    from pipeline.runtime.servers.mlx_omni import pool as mlx_omni

    names = ["mlx_omni_server", "mlx_omni_server.chat", "mlx_omni_server.chat.mlx"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    cache_module = types.ModuleType("mlx_omni_server.chat.mlx.prompt_cache")
    cache_module.PromptCache, cache_module.common_prefix_len = (
        StubPromptCache,
        stub_common_prefix_len,
    )
    pool_module = types.ModuleType("mlx_omni_server.chat.mlx.prompt_cache_pool")
    pool_module.PromptCachePool = StubPromptCachePool
    monkeypatch.setitem(sys.modules, cache_module.__name__, cache_module)
    monkeypatch.setitem(sys.modules, pool_module.__name__, pool_module)
    monkeypatch.setattr(mlx_omni, "model_folder", lambda key: mounted.model.resolve())
    pool_class = mlx_omni.pinned_pool_class(mounted, snapshots)
    pool = pool_class()

    def fetch(tokens):
        out = pool.get_cache(tokens, "m")
        shared = stub_common_prefix_len(out.tokens, tokens)
        return min(shared, len(tokens) - 1) if out.cache else 0  # omni trims to the shared part

    return SimpleNamespace(
        store=lambda t, c: pool.put_cache(StubPromptCache(t, c, "m")),
        fetch=fetch,
        warm_store=lambda t, c: pool.put_cache(StubPromptCache(t, c, "m")),
        stored=lambda: len(pool._entries),
        hook=SimpleNamespace(entries=lambda m, s: _omni_hook(pool_class).entries(m, s)),
    )


def _omni_hook(pool_class):
    from pipeline.runtime.servers.mlx_omni import Hook

    hook = Hook()
    hook.pools = pool_class  # as install sets it
    return hook


def openai_adapter(mounted, monkeypatch, snapshots=None):
    """mlx-openai-server's PinnedPromptCache over its LRU stub."""
    import sys
    import types

    for name in ("app", "app.utils"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    module = types.ModuleType("app.utils.prompt_cache")
    module.LRUPromptCache = StubOpenAILRU
    monkeypatch.setitem(sys.modules, module.__name__, module)
    from pipeline.runtime.servers.mlx_openai.model_process import pinned_cache_class
    from pipeline.runtime.servers.mlx_openai.saving_cache import disk_lru_entries

    cache = pinned_cache_class(mounted, snapshots)()
    return SimpleNamespace(
        store=lambda t, c: cache.insert_cache(t, c),
        fetch=lambda t: covered_by(*cache.fetch_nearest_cache(t), t),
        warm_store=None,  # its warm-up entries are dropped at the first client's lookup
        cache=cache,
        hook=SimpleNamespace(entries=lambda m, s: disk_lru_entries(cache, m, s, "openai")),
        save=cache.close,  # its handler's cleanup closes the cache: the model process saves
    )


ADAPTERS = ["mlx-lm", "mlx-omni-server", "mlx-openai-server"]


@pytest.fixture(params=ADAPTERS)
def hooked(request, monkeypatch, tiny_model):
    model = llama_model(hidden=128, heads=4)
    prefix = ids(24)
    manager = PromptCacheManager()
    manager.pin(BUNDLE_KEY, prefix, prefill(model, prefix)[0], "shop@1")
    mounted = Mounted(tiny_model, manager, SimpleNamespace(bundles=[]))
    if request.param == "mlx-lm":
        adapter = mlx_lm_adapter(mounted)
    elif request.param == "mlx-omni-server":
        adapter = omni_adapter(mounted, monkeypatch)
    else:
        adapter = openai_adapter(mounted, monkeypatch)
    adapter.server, adapter.prefix, adapter.model, adapter.manager = (
        request.param, prefix, model, manager,
    )  # fmt: skip
    return adapter


def test_every_hooked_cache_hands_out_the_bundle_and_leaves_a_token(hooked):
    assert hooked.fetch([*hooked.prefix, 7, 8]) == len(hooked.prefix)
    assert hooked.fetch(list(hooked.prefix)) == len(hooked.prefix) - 1  # an exact hit


def test_every_hooked_cache_prefers_its_own_longer_entry(hooked):
    longer = [*hooked.prefix, *ids(10)]
    hooked.store(longer, prefill(hooked.model, longer)[0])
    assert hooked.fetch([*longer, 5]) == len(longer)


def opening_apart(prefix: list[int], n: int) -> list[int]:
    """n random ids whose first differs from `prefix`'s (the fixture's exact bundle serves none)."""
    head = 2 if prefix[0] == 1 else 1
    return [head, *ids(n - 1)]


def test_every_hooked_cache_holds_its_own_lossy_entry_to_the_rule_also_after_a_remount(hooked):
    """An entry the server stored after a request continued a 4-bit bundle: a request sharing
    only its opening tokens is not served from it, while the bundle is pinned and after a remount
    removed it (the entry itself is quantized: its lossiness travels with it)."""
    lossy = opening_apart(hooked.prefix, 30)
    hooked.manager.pin(BUNDLE_KEY, lossy, quantized_bundle(hooked.model, lossy), "q@1")
    assert hooked.fetch([*lossy, 7]) == len(lossy)  # the request that continues it
    hooked.store(lossy, quantized_bundle(hooked.model, lossy))
    opening = [*lossy[:3], 99, 98]
    assert hooked.fetch(opening) == 0
    hooked.manager.unpin(BUNDLE_KEY, "q@1")  # a remount replaced or removed it
    assert hooked.fetch(opening) == 0
    assert hooked.fetch([*lossy, 99]) == len(lossy)  # its whole share: allowed


def test_every_hooked_cache_holds_its_own_quantized_entry_to_half_its_own_length(hooked):
    """An entry of quantized KV (the server's --kv-bits, or a request continued from a 4-bit
    bundle) serves a request only for at least half its own tokens, though its hand-out is
    trimmed to the shared part (before: mlx_lm.server served 1,334 of a 5,324-token 8-bit entry,
    floored only by the 361-token bundle's half)."""
    entry = opening_apart(hooked.prefix, 40)  # no bundle shares its opening
    hooked.store(entry, quantized_bundle(hooked.model, entry))
    assert hooked.fetch([*entry[:19], 99, 98]) == 0  # 19 of its 40 tokens
    assert hooked.fetch([*entry[:20], 99, 98]) == 20  # its half
    assert hooked.fetch([*entry, 99]) == 40


def test_a_lossy_bundle_no_request_took_leaves_the_servers_own_cache_whole(hooked):
    """A 4-bit bundle pinned, and the server's own exact entry for another prompt that shares
    only the template's opening with it: nothing can descend from a bundle no request took, so
    the entry serves its repeat whole (it was held to half the bundle: a lossy bundle made the
    server colder than no bundle). The warm-up's hand-out does not count."""
    lossy = opening_apart(hooked.prefix, 30)
    hooked.manager.pin(BUNDLE_KEY, lossy, quantized_bundle(hooked.model, lossy), "q@1")
    with hooked.manager.provisional():  # the warm-up took it: it keeps nothing
        hooked.fetch([*lossy, 7])
    other = [*lossy[:3], 2 if lossy[3] == 1 else 1, *lossy[4:12]]  # diverges after the opening
    hooked.store(other, prefill(hooked.model, other)[0])
    assert hooked.fetch([*other, 9]) == len(other)


def test_no_hooked_cache_keeps_the_warm_up_request(hooked):
    warm = [*hooked.prefix, 5, 6]
    warm_up.WARMING.set()
    try:
        if hooked.warm_store is not None:
            hooked.warm_store(warm, prefill(hooked.model, warm)[0])
        else:
            hooked.fetch(warm)  # the warm-up's lookup (openai: marks what follows as its own)
            hooked.store(warm, prefill(hooked.model, warm)[0])
    finally:
        warm_up.WARMING.clear()
    if hooked.server == "mlx-omni-server":
        assert hooked.stored() == 0
    elif hooked.server == "mlx-openai-server":
        hooked.fetch([*warm, 1])
        assert len(hooked.cache) == 0  # dropped at the first client's lookup


@pytest.mark.slow
def test_the_pool_and_lru_stubs_have_the_methods_and_parameters_of_the_installed_classes():
    import servers_env

    code = (
        "import inspect, json\n"
        "from mlx_omni_server.chat.mlx.prompt_cache import PromptCache\n"
        "from mlx_omni_server.chat.mlx.prompt_cache_pool import PromptCachePool\n"
        "from app.utils.prompt_cache import LRUPromptCache, PromptTrie, PromptTrieResult\n"
        "s = lambda f: list(inspect.signature(f).parameters)\n"
        "print(json.dumps({'pool': {n: s(getattr(PromptCachePool, n)) for n in "
        "('__init__', 'get_cache', 'put_cache', '_evict_expired')}, "
        "'cache': s(PromptCache), "
        "'lru': {n: s(getattr(LRUPromptCache, n)) for n in "
        "('__init__', 'fetch_nearest_cache', 'insert_cache', 'clear', 'close', '__len__', "
        "'_load_cache_from_disk')}, "
        "'search': s(PromptTrie.search), "
        "'result': sorted(vars(PromptTrieResult(None, None, None, 0)))}))\n"
    )
    python = servers_env.servers_python()
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    real = json.loads(done.stdout.strip().splitlines()[-1])
    shape = lambda f: list(inspect.signature(f).parameters)  # noqa: E731
    for name, params in real["pool"].items():
        assert params == shape(getattr(StubPromptCachePool, name)), name
    assert real["cache"] == shape(StubPromptCache)
    for name, params in real["lru"].items():
        assert params == shape(getattr(StubOpenAILRU, name)), name
    # the trie a hook asks which entry a trimmed hand-out came from (lru_cache.entry_length)
    assert real["search"] == ["self", *shape(StubOpenAILRU()._trie.search)]
    assert real["result"] == sorted(vars(StubOpenAILRU()._trie.search([1])))


@pytest.mark.parametrize(
    "server, rest, where, model",
    [
        ("mlx-lm", (), "127.0.0.1:8080", "models/m"),
        ("vllm-mlx", ("--served-model-name", "shop"), "127.0.0.1:8000", "shop"),
        ("rapid-mlx", ("--port", "9001"), "127.0.0.1:9001", "models/m"),
        ("mlx-omni-server", (), "127.0.0.1:10240", "models/m"),  # it binds 0.0.0.0
        ("mlx-openai-server", ("--host", "10.0.0.2"), "10.0.0.2:8000", "models/m"),
    ],
)
def test_every_server_says_which_model_id_clients_send_and_how_to_try_it(
    server: str, rest: tuple, where: str, model: str
):

    from pipeline.runtime.servers import hook_for
    from pipeline.runtime.servers.options import ServeOptions
    from pipeline.runtime.servers.startup import try_it

    options = ServeOptions(server, Path("models/m"), Path("b"), rest, (), True)
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}
    )
    url = f"http://{where}/v1/chat/completions"
    assert try_it(hook_for(server), options) == (
        f'{server}: clients send "model": "{model}" to {url}; once the port opens, try: '
        f"curl -s {url} -H 'Content-Type: application/json' -d '{body}'"
    )


# --- --snapshots through the pool and LRU hooks (omni; mlx-openai-server's model process) ----------


@pytest.fixture(params=["mlx-omni-server", "mlx-openai-server"])
def snap_hooked(request, shelf, monkeypatch, tiny_model):
    """A hook's cache subclass over its stub, answering from the restored EXACT and LOSSY
    snapshots (the `shelf` fixture) with no bundle pinned."""
    shelf.mounted.model = tiny_model
    if request.param == "mlx-omni-server":
        adapter = omni_adapter(shelf.mounted, monkeypatch, shelf.snaps)
        listed = lambda: adapter.hook.entries(shelf.mounted, shelf.snaps)  # noqa: E731
        adapter.save = lambda: shelf.snaps.save(listed(), lambda t: 0)  # serve, at the stop
    else:
        adapter = openai_adapter(shelf.mounted, monkeypatch, shelf.snaps)
    adapter.server, adapter.shelf = request.param, shelf
    return adapter


def test_a_hooked_pool_answers_from_restored_snapshots_under_the_rule(snap_hooked, caplog):
    h = snap_hooked
    with caplog.at_level(logging.INFO, logger="prefix-bundles"):
        assert h.fetch([*EXACT, 1, 2]) == len(EXACT)
    assert "request: snapshot " in caplog.text
    assert h.fetch(list(EXACT)) == len(EXACT) - 1  # always a token left
    # the lossy snapshot serves only its share (half of it), never a short overlap
    assert h.fetch([*LOSSY[:60], 1, 2]) == 0
    assert h.fetch([*LOSSY[:150], 1]) == 150
    # the server's own entry sharing its opening with the lossy snapshot is held to its rule
    h.store(LOSSY[:40], h.shelf.prefill(LOSSY[:40]))
    assert h.fetch([*LOSSY[:40], 3, 4]) == 0
    longer = [*EXACT, 77, 78]  # its own longer entry wins over the snapshot
    h.store(longer, h.shelf.prefill(longer))
    assert h.fetch([*longer, 5]) == len(longer)


@pytest.mark.parametrize("bundle, by", [(len(EXACT), "bundle shop@1"), (60, "request: snapshot")])
def test_a_hooked_pool_never_lets_a_snapshot_beat_an_exact_bundle(
    snap_hooked, caplog, bundle: int, by: str
):
    shelf = snap_hooked.shelf
    shelf.mounted.manager.pin(BUNDLE_KEY, EXACT[:bundle], shelf.prefill(EXACT[:bundle]), "shop@1")
    with caplog.at_level(logging.INFO, logger="prefix-bundles"):
        assert snap_hooked.fetch([*EXACT, 1]) == len(EXACT)
    lines = [r.getMessage() for r in caplog.records if "request:" in r.getMessage()]
    assert any(by in line for line in lines), lines
    if by.startswith("bundle"):
        assert not any("request: snapshot" in line for line in lines), lines


def test_a_hooked_pool_lists_its_entries_at_a_stop(snap_hooked, tmp_path, tiny_model):
    """Its own entries, cut to their KV (a last sampled token never fed), quantized and
    continued-from-lossy ones recorded lossy, in the order they were stored; nothing of the
    warm-up; saved and restored, the set answers as the entries did."""
    from pipeline.runtime.snapshots import DEFAULT_BUDGET, Snapshots

    h, shelf = snap_hooked, snap_hooked.shelf
    plain = [*EXACT[:30], 5, 6, 7]
    h.store([*plain, 8], shelf.prefill(plain))  # prompt + output: the last token never fed
    quantized = [(13 * i + 3) % 900 + 10 for i in range(20)]
    h.store(quantized, quantized_kv(shelf.prefill(quantized)))
    descends = [*LOSSY[:130], 4, 4]  # continued from the lossy snapshot a request took
    assert shelf.snaps.fetch(descends, better_than=0)[1] == 130
    h.store(descends, shelf.prefill(descends))
    ahead = [(7 * i + 5) % 900 + 10 for i in range(25)]  # omni feeds its finishing token
    h.store(ahead, shelf.prefill([*ahead, 9]))  # the KV runs one ahead: a copy cut to `ahead`
    if h.server == "mlx-omni-server":  # mlx-openai-server's: test_no_hooked_cache_keeps_...
        warm_up.WARMING.set()
        try:
            h.store([*EXACT[:20], 9], shelf.prefill([*EXACT[:20], 9]))
        finally:
            warm_up.WARMING.clear()
    listed = h.hook.entries(shelf.mounted, shelf.snaps)
    by_tokens = {tuple(e.tokens): (stamp, e) for stamp, e in listed}
    assert set(by_tokens) == {tuple(plain), tuple(quantized), tuple(descends), tuple(ahead)}
    assert [by_tokens[tuple(t)][1].lossy for t in (plain, quantized, descends)] == [0, 1, 1]
    assert {layer.offset for layer in by_tokens[tuple(ahead)][1].cache} == {len(ahead)}
    stamps = [by_tokens[tuple(t)][0] for t in (plain, quantized, descends, ahead)]
    assert stamps == sorted(stamps) and stamps[0] > 0
    h.save()
    shelf.snaps.close()
    again = Snapshots(tmp_path / "snaps", DEFAULT_BUDGET, tiny_model, None, "rapid-mlx")
    again.restore([])
    try:
        assert len(again) == 2 + 4  # EXACT and LOSSY, kept, and the server's four entries
        assert again.fetch([*plain, 1], better_than=0)[1] == len(plain)
        assert again.fetch([*quantized[:4], 1], better_than=0)[0] is None  # lossy: its share
        assert again.fetch([*quantized, 1], better_than=0)[1] == len(quantized)
        assert again.fetch([*ahead, 1], better_than=0)[1] == len(ahead)
    finally:
        again.close()


def quantized_kv(cache: list) -> list:
    """The layers as mlx-lm's QuantizedKVCache (what a --kv-bits server stores)."""
    return [layer.to_quantized(group_size=64, bits=8) for layer in cache]


def test_a_hook_that_declares_no_snapshots_is_refused_with_one_line(tmp_path):
    """Every wrapped server declares `snapshots` now; a hook that does not is refused before
    anything is loaded or created."""
    from pipeline.format.errors import PipelineError
    from pipeline.runtime.servers.hook import ServerHook
    from pipeline.runtime.servers.options import ServeOptions
    from pipeline.runtime.servers.startup import serve

    class Plain(ServerHook):
        name, package, address = "plain", "json", ("127.0.0.1", 1)

    options = ServeOptions(
        "plain", tmp_path / "m", tmp_path / "b", (), (), True, snapshots=tmp_path / "snaps"
    )
    with pytest.raises(PipelineError) as refused:
        serve(Plain(), options)
    assert str(refused.value) == (
        "--snapshots is not supported with --server plain yet (docs/snapshots.md lists the "
        "servers that support it); serve without --snapshots"
    )
    assert not (tmp_path / "snaps").exists()
