"""mlx-lm's LRUPromptCache (mlx_lm.models.cache: mlx_lm.server's prompt cache, and vllm-mlx's
prefix trie) as snapshots see it: a recency stamp per stored entry, and at a graceful stop its
entries for the served model, cut to what each cache holds. Shared by the hooks whose server
keeps one; owned by none."""

from __future__ import annotations

from typing import Any

from pipeline.runtime.prompt_cache import is_lossy
from pipeline.runtime.snapshot_store import Entry


def evaluate(cache: Any) -> None:
    """Evaluate every array a prompt cache holds, on this thread (a generation thread's arrays
    are lazy on its stream, which the main thread that saves them at a stop cannot evaluate)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    states = [layer.state for layer in cache or []]
    mx.eval([a for _, a in tree_flatten(states) if isinstance(a, mx.array)])


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
    from pipeline.runtime.servers.startup import BUNDLE_KEY

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
            lossy = (
                is_lossy(cache)
                or mounted.manager.lossy_floor(BUNDLE_KEY, ids) > 0
                or snapshots.lossy_floor(ids) > 0
            )
            source = f"{server} prompt cache ({cache_type})"
            recency = prompt_cache.stamps.get(tuple(tokens), 0)
            heads = continued_from(ids, mounted.result.bundles)
            listed.append((recency, Entry(ids, cache, source, lossy, heads)))
    return listed


def continued_from(ids: list[int], bundles: list[Any]) -> str | None:
    """NAME@VERSION of the longest mounted bundle whose tokens open `ids`."""
    heads = [b for b in bundles if len(b.tokens) <= len(ids) and ids[: len(b.tokens)] == b.tokens]
    return max(heads, key=lambda b: len(b.tokens)).name if heads else None


__all__ = ["evaluate", "lru_entries", "stamp"]
