"""The memory-aware prefix cache of the batched engines (vllm-mlx --continuous-batching and
rapid-mlx, whose MemoryAwarePrefixCache has vllm-mlx's interface), answering from the pinned
bundles and restored snapshots through the one lookup rule, and listing its entries for
snapshots at a graceful stop: shared by both hooks, owned by neither.

Both keep their entries as `_entries` (an OrderedDict, least recently used first) of
`_CacheEntry(tokens, cache, ...)`, cut to the KV offset; vllm-mlx stores quantized entries
(--kv-cache-quantization) as its own `_QuantizedCacheWrapper`, rapid-mlx as mlx-lm's
`QuantizedKVCache`. Both clear the cache when their engine stops (the scheduler's deep_reset),
before serve gets to save it: the entries held then are kept for the save (`install_memory_cache`).
"""

from __future__ import annotations

from typing import Any

from pipeline.runtime.prompt_cache import fork_cache, is_lossy, lossy_min_tokens
from pipeline.runtime.servers import usage, warm_up
from pipeline.runtime.servers.entries import evaluate, held_offset, server_entry
from pipeline.runtime.servers.mounted import Mounted


def pinned_memory_cache_class(
    mounted: Mounted, base: type, server: str, snapshots: Any = None
) -> type:
    """`base`, vllm-mlx's MemoryAwarePrefixCache (BatchedEngine's scheduler; rapid-mlx's has the
    same interface), also answering from the pinned bundles and the restored `snapshots`: they
    live outside its entries, so its LRU, memory limit and prefix-subset eviction never see them,
    and a request gets a copy (mlx-lm's BatchGenerator merges it)."""

    class PinnedMemoryCache(base):
        instances: list[Any] = []  # the scheduler's instance(s), listed at a graceful stop

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.stamps: dict[tuple[int, ...], int] = {}  # recency, for snapshots
            self.kept: list[tuple[tuple[int, ...], list]] | None = None  # at the engine's stop
            PinnedMemoryCache.instances.append(self)

        def fetch(self, tokens: list[int]) -> tuple[Any, list[int]]:
            answered = [False]  # the last call was answered by a restored snapshot

            def own(t: list[int]) -> tuple[Any, list[int]]:
                stats = getattr(self, "_stats", None)  # vllm-mlx's counters (its /v1/status)
                counted = _counts(stats)
                found = continued_where_its_kv_ends(t, base.fetch(self, t))
                if found[0] is not None and not self.usable(t, found):
                    self._last_match_type, self._last_matched_key = "miss", None
                    if counted is not None:  # its counters say a hit: the request gets none
                        stats.hits, stats.tokens_saved = counted
                        stats.misses += 1
                    return None, list(t)
                if found[0] is not None and snapshots is not None:
                    key = getattr(self, "_last_matched_key", None) or next(
                        reversed(self._entries), None
                    )  # rapid-mlx names no key: the hit entry is the most recent
                    self.stamps[tuple(key or ())] = snapshots.tick()
                return found

            def fetch(t: list[int]) -> tuple[Any, list[int]]:
                answered[0] = False
                return own(t)

            mark = lambda name: answered.__setitem__(0, True)  # noqa: E731
            cache, rest, from_bundle = mounted.answer(server, tokens, fetch, True, snapshots, mark)
            if from_bundle or (cache is not None and answered[0]):
                # the scheduler records the match; a bundle or snapshot is no entry of its own
                self._last_match_type, self._last_matched_key = "prefix", None
            usage.record(0 if cache is None else len(tokens) - len(rest), len(tokens))
            return cache, rest

        def usable(self, tokens: list[int], found: tuple[Any, list[int]]) -> bool:
            """Its own entry under the lossy rule, where its hand-out hides that it is lossy:
            with --kv-cache-quantization (and rapid-mlx's --kv-cache-turboquant) both store
            quantized entries and hand them out dequantized. The entry is the one vllm-mlx's
            fetch names in `_last_matched_key`; rapid-mlx names none and moves its hit last.
            What counts is what the request keeps: an exact hit is handed out a token short."""
            key = getattr(self, "_last_matched_key", None) or next(reversed(self._entries), None)
            entry = self._entries.get(tuple(key)) if key else None
            if entry is None or not is_lossy(entry.cache):
                return True
            kept = min(len(tokens) - len(found[1]), len(tokens) - 1)
            return kept >= lossy_min_tokens(len(key))

        def store(self, tokens: list[int], *args: Any, **kwargs: Any) -> Any:
            if warm_up.WARMING.is_set():  # the warm-up request leaves no entry
                return False
            stored = super().store(tokens, *args, **kwargs)
            entry = self._entries.get(tuple(tokens)) if snapshots is not None else None
            if stored and entry is not None:  # evaluated on the thread that made it
                evaluate(entry.cache)
                self.stamps[tuple(tokens)] = snapshots.tick()
                if len(self.stamps) > 4 * len(self._entries) + 64:
                    self.stamps = {k: v for k, v in self.stamps.items() if k in self._entries}
                snapshots.changed()  # the scheduler's thread, which alone stores: the capture
            return stored

        def keep(self) -> None:
            """Hold the entries now in the cache for the save (its engine is stopping)."""
            if snapshots is not None:  # without --snapshots nothing is saved: hold nothing
                self.kept = [(key, entry.cache) for key, entry in list(self._entries.items())]

    return PinnedMemoryCache


def continued_where_its_kv_ends(
    tokens: list[int], found: tuple[Any, list[int]]
) -> tuple[Any, list[int]]:
    """The cache's own hand-out (cache, rest) with its K/V exactly as long as the tokens it says are
    cached: vllm-mlx stores a prompt's entry with K/V one token short of its key (its
    prompt_cache_save, for its scheduler to re-feed the last token), and its prefix and
    longest-common-prefix matches then continue one position behind; the rest starts where the K/V
    ends. K/V ahead of them is cut from a copy (never the stored entry), else not handed out."""
    cache, rest = found
    held, covered = held_offset(cache), len(tokens) - len(rest)
    if cache is None or held is None or held == covered:
        return cache, rest
    if held < covered:
        return cache, list(tokens[held:])
    if all(layer.is_trimmable() for layer in cache):
        return fork_cache(cache, held - covered), rest
    return None, list(tokens)


def _counts(stats: Any) -> tuple[int, int] | None:
    """(hits, tokens saved) of a cache's own counters, None where it keeps none."""
    hits, saved = getattr(stats, "hits", None), getattr(stats, "tokens_saved", None)
    ok = isinstance(hits, int) and isinstance(saved, int) and hasattr(stats, "misses")
    return (hits, saved) if ok else None


def install_memory_cache(scheduler: Any, mounted: Mounted, server: str, snapshots: Any) -> type:
    """Put `pinned_memory_cache_class` in the engine's `scheduler` module; the scheduler's
    deep_reset (its engine's stop) clears the cache before serve saves it, so what the cache held
    at that moment is kept (the last reset's entries are what a stop leaves)."""
    cache_class = pinned_memory_cache_class(
        mounted, scheduler.MemoryAwarePrefixCache, server, snapshots
    )
    scheduler.MemoryAwarePrefixCache = cache_class
    original = scheduler.Scheduler.deep_reset

    def deep_reset(self: Any, *args: Any, **kwargs: Any) -> Any:
        cache = getattr(self, "memory_aware_cache", None)
        if isinstance(cache, cache_class):
            cache.keep()
        return original(self, *args, **kwargs)

    scheduler.Scheduler.deep_reset = deep_reset
    return cache_class


def memory_entries(
    cache_class: type, mounted: Mounted, snapshots: Any, server: str
) -> list[tuple[int, Any]]:
    """Every entry of the memory-aware cache(s) (those kept at the engine's stop, else the live
    ones), as (recency, snapshot Entry), cut to the KV each holds; lossiness as lru_cache records
    it (quantized KV, or an opening shared with a lossy bundle or snapshot)."""
    listed = []
    for cache in cache_class.instances:
        held = cache.kept
        if held is None:
            held = [(key, entry.cache) for key, entry in list(cache._entries.items())]
        for key, layers in held:
            saved = saved_layers(layers)
            offsets = {getattr(layer, "offset", None) for layer in saved}
            count = offsets.pop() if len(offsets) == 1 else None
            if not isinstance(count, int) or not 1 <= count <= len(key):
                continue
            source = f"{server} memory-aware prefix cache"
            entry = server_entry(list(key[:count]), saved, source, mounted, snapshots)
            listed.append((cache.stamps.get(tuple(key), 0), entry))
    return listed


def saved_layers(layers: list) -> list:
    """The layers as mlx-lm cache objects: vllm-mlx's `_QuantizedCacheWrapper` of a KVCache
    holds mx.quantize's (weights, scales, biases), exactly a QuantizedKVCache's keys and values;
    every other layer is left as it is (snapshot_store saves KVCache and QuantizedKVCache)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    out = []
    for layer in layers:
        wrapped = type(layer).__name__ == "_QuantizedCacheWrapper"
        # it records KVCache's class attribute `step` too: nothing a QuantizedKVCache lacks
        plain = set(getattr(layer, "orig_attrs", None) or ()) <= {"step"}
        if wrapped and getattr(layer, "orig_type", None) is KVCache and plain:
            quantized = QuantizedKVCache(group_size=layer.group_size, bits=layer.bits)
            quantized.keys, quantized.values = tuple(layer.keys), tuple(layer.values)
            quantized.offset = layer.offset
            layer = quantized
        out.append(layer)
    return out


__all__ = ["install_memory_cache", "memory_entries", "pinned_memory_cache_class"]
