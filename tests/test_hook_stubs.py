"""Fast tests of a hook's cache subclass without the server's venv (issue 37): a stub shaped like
the server's own cache class stands in for it, and the subclass must hand out a bundle, leave at
least one token, hold the server's own lossy entries to the rule (also after a remount), keep
nothing while warming up and report usage. A slow test checks each stub against the installed
server's class (the methods and parameters the hook relies on), so a stub cannot drift."""

from __future__ import annotations

import inspect
import json
import subprocess
from types import SimpleNamespace

import pytest
from test_prompt_cache import ids, llama_model, prefill, quantized_bundle

from pipeline.runtime.prompt_cache import PromptCacheManager
from pipeline.runtime.servers import usage, warm_up
from pipeline.runtime.servers.memory_cache import pinned_memory_cache_class
from pipeline.runtime.servers.startup import BUNDLE_KEY


class StubMemoryAwarePrefixCache:
    """vllm-mlx's / rapid-mlx's MemoryAwarePrefixCache as the hook uses it: whole-sequence keys,
    `fetch(tokens) -> (cache or None, rest)` by longest stored prefix, `store(tokens, cache)`."""

    def __init__(self) -> None:
        self.entries: dict[tuple[int, ...], list] = {}
        self._last_match_type, self._last_matched_key = None, None

    def fetch(self, tokens: list[int]) -> tuple[list | None, list[int]]:
        keys = [k for k in self.entries if tuple(tokens[: len(k)]) == k and len(k) < len(tokens)]
        if not keys:
            return None, list(tokens)
        best = max(keys, key=len)
        return self.entries[best], list(tokens[len(best) :])

    def store(self, tokens: list[int], cache: list) -> bool:
        self.entries[tuple(tokens)] = cache
        return True


@pytest.fixture
def pinned_cache():
    """The hook's subclass of the stub, over a manager with one full-precision bundle pinned."""
    model = llama_model(hidden=128, heads=4)
    prefix = ids(24)
    manager = PromptCacheManager()
    manager.pin(BUNDLE_KEY, prefix, prefill(model, prefix)[0], "shop@1")
    mounted = SimpleNamespace(manager=manager)
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
    assert pinned_cache.cache.entries == {}


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
    from pipeline.runtime.servers.mlx_openai import keep_what_serve_validated
    from pipeline.runtime.servers.startup import Mounted

    manager = PromptCacheManager()
    result = mount(tiny_model, [shop_bundle], manager=manager, model_key=BUNDLE_KEY)
    mounted = Mounted(tiny_model, manager, result)
    request = [*result.bundles[0].tokens, 1]
    keep_what_serve_validated(
        mounted, {str(shop_bundle): result.bundles[0].manifest.cache.file_sha256}
    )
    assert manager.covered(BUNDLE_KEY, request) > 0
    with caplog.at_level(logging.WARNING, logger="prefix-bundles"):
        keep_what_serve_validated(mounted, {str(shop_bundle): "0" * 64})
    assert mounted.result.bundles == [] and manager.covered(BUNDLE_KEY, request) == 0
    assert "changed after serve validated it" in caplog.text


# --- vllm-mlx's SimpleEngine trie: serve's PinnedTrie over mlx-lm's own LRUPromptCache ------------


@pytest.fixture
def trie():
    """vllm-mlx's pinned trie (mlx-lm's LRUPromptCache, installed here too) with one bundle."""
    from pipeline.runtime.servers.vllm_mlx import pinned_trie_class

    model = llama_model(hidden=128, heads=4)
    prefix = ids(24)
    manager = PromptCacheManager()
    manager.pin(BUNDLE_KEY, prefix, prefill(model, prefix)[0], "shop@1")
    mounted = SimpleNamespace(manager=manager, result=SimpleNamespace(bundles=[object()]))
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
    cache, rest = trie.trie.fetch_nearest_cache({"model": 1}, list(trie.prefix))
    assert cache is not None and len(rest) >= 1  # an exact hit leaves a token
    assert len(trie.trie) >= 1  # vllm-mlx skips an empty trie: pinned bundles count


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
    assert len(trie.trie) == 1  # only the pinned bundle
    trie.trie.insert_cache({"model": 1}, [1, 2, 3], prefill(trie.model, [1, 2, 3])[0])
    assert len(trie.trie) == 2  # outside the warm-up it keeps entries (--prefix-trie-cache)
