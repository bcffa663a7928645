"""mlx-openai-server's LRUPromptCache (app.utils.prompt_cache: mlx-lm's, its entries kept on disk)
as serve runs it in the model process: answering through `pinned_lru_class`, and saving its
entries when its handler closes it at the graceful stop."""

from __future__ import annotations

import logging
from typing import Any

from pipeline.format.errors import PipelineError
from pipeline.runtime.servers.entries import held_entry
from pipeline.runtime.servers.lru_cache import pinned_lru_class
from pipeline.runtime.snapshot_store import Entry

log = logging.getLogger("prefix-bundles")


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


def deferred_lru_entries(prompt_cache: Any, mounted: Any, snapshots: Any, server: str) -> list:
    """`disk_lru_entries` for a spill: listed on the thread that stores (its tokens, recency and
    file, as they are now), each entry's KV read back from its own file on the spill thread (one
    evicted meanwhile is skipped there), so the request path never reads a file."""
    listed, read = [], prompt_cache._load_cache_from_disk
    for cache_type, lru in prompt_cache._lru._lrus.items():
        for tokens in list(lru):
            entry = prompt_cache._trie.get(list(tokens))
            recency = prompt_cache.stamps.get(tuple(tokens), 0)
            source = f"{server} prompt cache ({cache_type})"

            def load(entry=entry, tokens=tokens, recency=recency, source=source) -> Any:
                return held_entry(recency, tokens, read(entry), source, mounted, snapshots)

            listed.append(load)
    return listed


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


__all__ = ["deferred_lru_entries", "disk_lru_entries", "saving_lru_class"]
