"""A server's own prompt-cache entries as snapshots save them, whichever cache held them: its KV
evaluated on the thread that made it (`evaluate`), cut to the tokens it holds (`held_entry`,
`held_offset`), with the lossiness the one rule sees and the bundle it continues
(`server_entry`). Used by every room that lists its server's entries."""

from __future__ import annotations

from typing import Any

from pipeline.runtime.prompt_cache import fork_cache, is_lossy
from pipeline.runtime.servers.mounted import BUNDLE_KEY
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


__all__ = ["continued_from", "evaluate", "held_entry", "held_offset", "server_entry"]
