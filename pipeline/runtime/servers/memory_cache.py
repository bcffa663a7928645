"""The memory-aware prefix cache of the batched engines (vllm-mlx --continuous-batching and
rapid-mlx, whose MemoryAwarePrefixCache has vllm-mlx's interface), answering from the pinned
bundles through the one lookup rule: shared by both hooks, owned by neither."""

from __future__ import annotations

from typing import Any

from pipeline.runtime.lookup import lookup_source
from pipeline.runtime.servers import usage, warm_up
from pipeline.runtime.servers.startup import BUNDLE_KEY, Mounted


def pinned_memory_cache_class(mounted: Mounted, base: type, server: str) -> type:
    """`base`, vllm-mlx's MemoryAwarePrefixCache (BatchedEngine's scheduler; rapid-mlx's has the
    same interface), also answering from the pinned bundles: they live outside its entries, so
    its LRU, memory limit and prefix-subset eviction never see them, and a request gets a copy
    (mlx-lm's BatchGenerator merges it)."""

    class PinnedMemoryCache(base):
        def fetch(self, tokens: list[int]) -> tuple[Any, list[int]]:
            own = super().fetch
            cache, rest, from_bundle = lookup_source(
                server, mounted.manager, BUNDLE_KEY, tokens, own, batched=True
            )
            if from_bundle:  # the scheduler records the match; a bundle is no entry of its own
                self._last_match_type, self._last_matched_key = "prefix", None
            usage.record(0 if cache is None else len(tokens) - len(rest))
            return cache, rest

        def store(self, *args: Any, **kwargs: Any) -> Any:
            if warm_up.WARMING.is_set():  # the warm-up request leaves no entry
                return False
            return super().store(*args, **kwargs)

    return PinnedMemoryCache


__all__ = ["pinned_memory_cache_class"]
