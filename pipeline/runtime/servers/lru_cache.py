"""mlx-lm's LRUPromptCache (mlx_lm.models.cache: mlx_lm.server's prompt cache, and vllm-mlx's
prefix trie) as snapshots see it: a recency stamp per stored entry, and at a graceful stop its
entries for the served model, cut to what each cache holds. Shared by the hooks whose server
keeps one; owned by none. `server_entry` records any server's entry (memory_cache.py too)."""

from __future__ import annotations

from typing import Any

from pipeline.runtime.prompt_cache import is_lossy
from pipeline.runtime.snapshot_store import Entry


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
        live = {tuple(t) for lru in prompt_cache._lru._lrus.values() for _, t in lru}
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
            offsets = {getattr(layer, "offset", None) for layer in cache}
            held = offsets.pop() if len(offsets) == 1 else None
            if not isinstance(held, int) or held > len(tokens) or held < 1:
                continue
            ids = list(tokens[:held])
            source = f"{server} prompt cache ({cache_type})"
            recency = prompt_cache.stamps.get(tuple(tokens), 0)
            listed.append((recency, server_entry(ids, cache, source, mounted, snapshots)))
    return listed


def server_entry(ids: list[int], cache: Any, source: str, mounted: Any, snapshots: Any) -> Entry:
    """A server's entry covering `ids` as snapshots save it: lossy when it holds quantized KV or
    may descend from lossy KV (its opening shared with a lossy bundle pinned at any time in this
    process, or with a lossy restored snapshot), with the longest bundle that opens it."""
    from pipeline.runtime.servers.startup import BUNDLE_KEY

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


__all__ = ["evaluate", "lru_entries", "server_entry", "stamp"]
