"""The one lookup rule every wrapped server gets: its own cache and the pinned bundles compared,
never an entry with nothing left to process, never a lossy entry for a short overlap, and the
batched path handed only caches it can merge.

A hook's subclass of its server's prompt cache reaches it through `Mounted.answer`
(pipeline.runtime.servers.mounted: restored snapshots first, then this rule); what differs per
server is only how its own cache is asked. A pool that checks entries out by its own scan
(mlx-omni-server's: servers/mlx_omni/pool.py) applies the same rule's parts where it decides
(which own entry a prompt may take, the bundle's `manager.fetch`, `log_request`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from pipeline.runtime.batching import NotBatchable, for_batching
from pipeline.runtime.prompt_cache import CacheHit, PromptCacheManager, at_least_one_left

log = logging.getLogger("prefix-bundles")
Fetch = Callable[[list[int]], tuple[Any, list[int]]]  # tokens -> (cache or None, rest)


def lookup_source(
    server: str,
    manager: PromptCacheManager,
    model_key: str,
    tokens: Sequence[int],
    own_fetch: Fetch,
    batched: bool,
    bundles: bool = True,
) -> tuple[Any, list[int], bool]:
    """(cache, tokens left, whether the cache came from a bundle) for a request: the server's own
    entry (`own_fetch`) or a pinned bundle, whichever serves more under the rules; `batched`: the
    server's path merges caches (a quantized bundle is handed over dequantized); `bundles=False`:
    the server's own entries only, under the same rule."""
    tokens = list(tokens)
    own, rest = at_least_one_left(own_fetch, tokens)
    covered = len(tokens) - len(rest)
    if own is not None and covered < manager.lossy_floor(model_key, tokens, own):
        own, rest, covered = None, tokens, 0  # may continue lossy KV: not this short
    hit = manager.fetch(model_key, tokens) if bundles else CacheHit(None, tokens, 0, "cold")
    from_bundle = bundles and log_request(server, hit, len(tokens), covered, batched)
    if from_bundle:
        cache, rest = hit.cache, list(hit.remaining)
    else:
        cache = own
    if cache is None or not batched:
        return cache, rest, from_bundle
    try:  # the server's own entries too: one stored after a single-path request is quantized
        return for_batching(cache), rest, from_bundle
    except NotBatchable as exc:  # none seen: every kind the validator allows converts
        log.warning("%s: prompt cache not reused on the batched path: %s", server, exc)
        return None, tokens, False


def log_request(
    server: str, hit: CacheHit, total: int, own: int = 0, batched: bool | None = None
) -> bool:
    """One line per request: how many of its prompt tokens a bundle covered, and whether the
    server's own entry covered more. True when the bundle is used."""
    name = hit.source.removeprefix("bundle:")
    if hit.cache is None:
        log.info("%s request: no bundle covers its %d prompt tokens", server, total)
        return False
    if hit.cache_hit_tokens <= own:
        log.info(
            "%s request: bundle %s covers %d of %d prompt tokens; the server's own cache "
            "covers %d, and is used",
            server,
            name,
            hit.cache_hit_tokens,
            total,
            own,
        )
        return False
    path = "" if batched is None else (" (batched path)" if batched else " (single path)")
    log.info(
        "%s request: bundle %s covers %d of %d prompt tokens%s",
        server,
        name,
        hit.cache_hit_tokens,
        total,
        path,
    )
    return True


__all__ = ["Fetch", "log_request", "lookup_source"]
