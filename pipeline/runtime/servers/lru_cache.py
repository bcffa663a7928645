"""mlx-lm's LRUPromptCache family (mlx_lm.models.cache: mlx_lm.server's prompt cache, vllm-mlx's
prefix trie, and the disk-backed copy one server keeps): the base of every subclass that answers
from the pinned bundles under the one rule (`pinned_lru_class`), a recency stamp per stored entry,
and at a graceful stop its entries for the served model, cut to what the cache holds. Shared by
the rooms whose server keeps one; owned by none."""

from __future__ import annotations

from typing import Any

from pipeline.runtime.prompt_cache import is_lossy, lossy_min_tokens
from pipeline.runtime.servers.entries import evaluate, held_entry
from pipeline.runtime.snapshot_store import Entry


def stamp(prompt_cache: Any, tokens: list[int], tick: int) -> None:
    """Record an entry's recency in `prompt_cache.stamps`, forgetting evicted entries' stamps."""
    stamps = prompt_cache.stamps
    stamps[tuple(tokens)] = tick
    if len(stamps) > 4 * max(len(prompt_cache), 16):
        # mlx-lm keeps (model, tokens), mlx-openai-server (one model per process) tokens alone
        items = [i for lru in prompt_cache._lru._lrus.values() for i in lru if len(i)]
        live = {tuple(i) if isinstance(i[0], int) else tuple(i[1]) for i in items}
        prompt_cache.stamps = {k: v for k, v in stamps.items() if k in live}


def lru_entries(
    prompt_cache: Any, model_key: Any, mounted: Any, snapshots: Any, server: str
) -> list[tuple[int, Entry]]:
    """The entries for `model_key` with their recency stamps (mlx-lm 0.31/0.32 keep (model,
    tokens) per cache type in `_lru._lrus` and the entries in `_trie`). Tokens are cut to what the
    cache holds (a last sampled token was never fed to it); lossiness is recorded as the lookup
    rule sees it now, and on the entry when it was stored."""
    listed = []
    for cache_type, lru in prompt_cache._lru._lrus.items():
        for model, tokens in list(lru):
            if model != model_key:
                continue
            cache = prompt_cache._trie.get(model, tokens).prompt_cache
            recency = prompt_cache.stamps.get(tuple(tokens), 0)
            source = f"{server} prompt cache ({cache_type})"
            listed.append(held_entry(recency, tokens, cache, source, mounted, snapshots))
    return [pair for pair in listed if pair is not None]


def pinned_lru_class(base: type, mounted: Any, snapshots: Any, server: str) -> type:
    """`base` (an mlx-lm-style LRUPromptCache) with what every hook's subclass of it shares: its
    `instances` (listed at a graceful stop), `answer` (the one rule over its own entries, the
    restored `snapshots` and the pinned bundles) and `stamped` (an entry's recency, for
    snapshots, evaluated on the thread that stored it, and the spill's capture there)."""

    class PinnedLRU(base):
        instances: list[Any] = []

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.stamps: dict[tuple[int, ...], int] = {}
            PinnedLRU.instances.append(self)

        def answer(
            self, tokens: list[int], own: Any, batched: bool, bundles: bool = True, key: Any = None
        ) -> Any:
            """`own(tokens)` asks this trie under `key` (None: a trie of one model, no key)."""

            def held_to_its_length(t: list[int]) -> tuple[Any, list[int]]:
                cache, rest = own(t)  # a quantized entry: only for its share of its own length
                if cache is not None and is_lossy(cache):
                    if len(t) - len(rest) < lossy_min_tokens(self.entry_length(key, t)):
                        return None, list(t)
                return cache, rest

            fetch = held_to_its_length
            return mounted.answer(server, tokens, fetch, batched, snapshots, bundles=bundles)

        def entry_length(self, key: Any, tokens: list[int]) -> int:
            """The length of the stored entry the trie hands out for `tokens` (a longer one is
            handed out trimmed: the hand-out hides its length), picked as mlx-lm's
            fetch_nearest_cache picks it."""
            found = self._trie.search(*(() if key is None else (key,)), list(tokens))
            shorter = len(found.shorter) if found.shorter is not None else 0
            if found.exact is not None:
                return len(tokens)
            if found.longer is not None and found.common_prefix > shorter:
                return len(found.longer)
            return shorter

        def stamped(self, tokens: list[int], cache: Any) -> None:
            """After the server stored an entry, on its thread: its recency, and a capture of
            the entries for the next spill (snapshot_spill)."""
            if snapshots is not None:
                evaluate(cache)
                stamp(self, tokens, snapshots.tick())
                snapshots.changed()

    return PinnedLRU


__all__ = ["lru_entries", "pinned_lru_class", "stamp"]
