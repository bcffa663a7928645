"""mlx-lm's LRUPromptCache (mlx_lm.models.cache: mlx_lm.server's prompt cache, and vllm-mlx's
prefix trie) and mlx-openai-server's disk-backed copy of it (app.utils.prompt_cache) as snapshots
see them: a recency stamp per stored entry, and at a graceful stop their entries for the served
model, cut to what each cache holds. Shared by the hooks whose server keeps one; owned by none.
`server_entry` and `held_entry` record any server's entry (memory_cache.py and omni's pool too),
`held_offset` says how many tokens an entry's KV holds."""

from __future__ import annotations

import logging
from typing import Any

from pipeline.format.errors import PipelineError
from pipeline.runtime.prompt_cache import fork_cache, is_lossy, lossy_min_tokens
from pipeline.runtime.snapshot_store import Entry

log = logging.getLogger("prefix-bundles")


def evaluate(cache: Any) -> None:
    """Evaluate every array a prompt cache holds, on this thread (a generation thread's arrays
    are lazy on its stream, which the main thread that saves them at a stop cannot evaluate)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    # vllm-mlx's quantized wrapper has no `state`: its keys and values are the arrays
    states = [_state(layer) for layer in cache or []]
    mx.eval([a for _, a in tree_flatten(states) if isinstance(a, mx.array)])


def _state(layer: Any) -> Any:
    try:
        return layer.state
    except AttributeError:
        return [getattr(layer, "keys", None), getattr(layer, "values", None)]


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


def disk_lru_entries(
    prompt_cache: Any, mounted: Any, snapshots: Any, server: str
) -> list[tuple[int, Entry]]:
    """mlx-openai-server's LRUPromptCache (one model per process): tokens per cache type in
    `_lru._lrus`, a CacheEntry per tokens in `_trie`, the KV read back from its own file."""
    listed = []
    for cache_type, lru in prompt_cache._lru._lrus.items():
        for tokens in list(lru):
            try:
                cache = prompt_cache._load_cache_from_disk(prompt_cache._trie.get(list(tokens)))
            except Exception:  # noqa: BLE001 - its file is gone: nothing to save
                continue
            recency = prompt_cache.stamps.get(tuple(tokens), 0)
            source = f"{server} prompt cache ({cache_type})"
            listed.append(held_entry(recency, tokens, cache, source, mounted, snapshots))
    return [pair for pair in listed if pair is not None]


def pinned_lru_class(base: type, mounted: Any, snapshots: Any, server: str) -> type:
    """`base` (an mlx-lm-style LRUPromptCache) with what every hook's subclass of it shares: its
    `instances` (listed at a graceful stop), `answer` (the one rule over its own entries, the
    restored `snapshots` and the pinned bundles) and `stamped` (an entry's recency, for
    snapshots, evaluated on the thread that stored it)."""

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
            if snapshots is not None:
                evaluate(cache)
                stamp(self, tokens, snapshots.tick())

    return PinnedLRU


def saving_lru_class(base: type, mounted: Any, snapshots: Any, server: str) -> type:
    """mlx-openai-server's LRUPromptCache (`pinned_lru_class`), saving its entries when its
    handler closes it at the graceful stop its parent orders (its workers have stopped; the close
    deletes the entries' files). Entries of a warm-up no client followed are dropped."""

    class SavingPromptCache(pinned_lru_class(base, mounted, snapshots, server)):
        def insert_cache(self, tokens_ids: list[int], prompt_cache: Any, **kwargs: Any) -> None:
            super().insert_cache(tokens_ids, prompt_cache, **kwargs)
            self.stamped(tokens_ids, prompt_cache)

        def close(self) -> None:
            if snapshots is None:
                return super().close()
            if getattr(type(self), "warmed_up", False):
                self.clear()
            try:  # (not when what the server loaded is unknown: Mounted.loaded_as_fingerprinted)
                if mounted.loaded_as_fingerprinted():
                    entries = disk_lru_entries(self, mounted, snapshots, server)
                    snapshots.save(entries, mounted.covered)
            except PipelineError as exc:  # in the server's own cleanup: one line, not its trace
                log.error("%s", exc)
            finally:
                super().close()

    return SavingPromptCache


def held_entry(
    recency: int, tokens: Any, cache: Any, source: str, mounted: Any, snapshots: Any
) -> tuple[int, Entry] | None:
    """(recency, Entry) of a server's entry, its tokens cut to the KV its cache holds (a last
    sampled token was never fed to it), or a copy of its KV cut to its tokens (omni feeds the
    finishing token, which it does not record); None when the layers disagree or hold nothing."""
    held = held_offset(cache)
    if held is not None and held > len(tokens) and all(c.is_trimmable() for c in cache):
        cache, held = fork_cache(cache, held - len(tokens)), len(tokens)
    if held is None or held > len(tokens):
        return None
    return recency, server_entry(list(tokens[:held]), cache, source, mounted, snapshots)


def held_offset(cache: Any) -> int | None:
    """The number of tokens every layer of `cache` holds KV for; None when they disagree or hold
    none."""
    offsets = {getattr(layer, "offset", None) for layer in cache or []}
    held = offsets.pop() if len(offsets) == 1 else None
    return held if isinstance(held, int) and held > 0 else None


def server_entry(ids: list[int], cache: Any, source: str, mounted: Any, snapshots: Any) -> Entry:
    """A server's entry covering `ids` as snapshots save it: lossy when it holds quantized KV or
    may descend from lossy KV (its opening shared with a lossy bundle pinned at any time in this
    process, or with a lossy restored snapshot), with the longest bundle that opens it."""
    from pipeline.runtime.servers.mounted import BUNDLE_KEY

    lossy = (
        is_lossy(cache)
        or mounted.manager.lossy_floor(BUNDLE_KEY, ids) > 0
        or snapshots.lossy_floor(ids) > 0
    )
    return Entry(ids, cache, source, lossy, continued_from(ids, mounted.result.bundles))


def continued_from(ids: list[int], bundles: list[Any]) -> str | None:
    """NAME@VERSION of the longest mounted bundle whose tokens open `ids`."""
    heads = [b for b in bundles if len(b.tokens) <= len(ids) and ids[: len(b.tokens)] == b.tokens]
    return max(heads, key=lambda b: len(b.tokens)).name if heads else None


__all__ = [
    "disk_lru_entries",
    "evaluate",
    "held_entry",
    "held_offset",
    "lru_entries",
    "pinned_lru_class",
    "saving_lru_class",
    "server_entry",
    "stamp",
]
