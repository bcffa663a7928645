"""mlx-omni-server's prompt pool (`PromptCachePool`) answering from the pinned bundles: omni checks
an entry out by its own longest-common-prefix scan, so this subclass applies the one rule's parts
where omni decides (which of its entries a prompt may take, a bundle or restored snapshot that
covers more, the checkout cut to what the rule keeps)."""

from __future__ import annotations

import threading
from functools import cache
from pathlib import Path
from typing import Any

from pipeline.runtime.lookup import log_request
from pipeline.runtime.prompt_cache import fork_cache
from pipeline.runtime.servers import warm_up
from pipeline.runtime.servers.entries import evaluate, held_offset
from pipeline.runtime.servers.mounted import BUNDLE_KEY, Mounted
from pipeline.runtime.snapshots import snapshot_answer

SERVER = "mlx-omni-server"


@cache
def model_folder(model_id: str) -> Path | None:
    """The local folder omni loads for a request's `model` (a path or a cached hub snapshot)."""
    path = Path(model_id).expanduser()
    if path.is_dir():
        return path.resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_id, local_files_only=True)).resolve()
    except Exception:  # not a hub id, or not downloaded: not the bundles' folder
        return None


def pinned_pool_class(mounted: Mounted, snapshots: Any = None) -> type:
    """omni's PromptCachePool, answering from the pinned bundles (and restored `snapshots`) when
    they cover more than its own entries the one rule allows."""
    from mlx_omni_server.chat.mlx.prompt_cache import PromptCache
    from mlx_omni_server.chat.mlx.prompt_cache_pool import PromptCachePool

    folder = mounted.model.resolve()

    class PinnedPromptCachePool(PromptCachePool):
        instances: dict[int, Any] = {}  # every pool that kept an entry, listed at a graceful stop
        # omni's pools have no lock and its request threads use them: every checkout, store
        # and listing (a spill's capture, the stop's save) holds this one
        lock = threading.RLock()

        def get_cache(self, prompt_tokens: list[int], model_key: str) -> Any:
            with PinnedPromptCachePool.lock:
                return self._get_cache(prompt_tokens, model_key)

        def _get_cache(self, prompt_tokens: list[int], model_key: str) -> Any:
            if model_folder(model_key) != folder:
                return super().get_cache(prompt_tokens, model_key)
            self._evict_expired()
            fine = mounted.loaded_as_fingerprinted()  # else no bundle or snapshot answers
            shelf = snapshots if fine else None
            ours = [e.cache for e in self._entries if e.cache.model_key == model_key]
            keeps = {id(c): usable_tokens(mounted, c, prompt_tokens, shelf) for c in ours}
            own = max(keeps.values(), default=0)
            hit = mounted.manager.fetch(BUNDLE_KEY, prompt_tokens if fine else [])
            better = max(own, hit.cache_hit_tokens)  # a snapshot answers only where it covers more
            found, keep, _ = snapshot_answer(shelf, prompt_tokens, better, SERVER)
            if found is None and log_request(SERVER, hit, len(prompt_tokens), own):
                found, keep = hit.cache, hit.cache_hit_tokens
            if found is not None:  # a checkout omni extends by the rest of the prompt, then returns
                return PromptCache(list(prompt_tokens[:keep]), found, model_key)
            held = {i for i, n in keeps.items() if n == 0}
            kept = self._entries  # omni's own checkout over the entries the rule allows
            self._entries = [e for e in kept if id(e.cache) not in held]
            try:
                out = super().get_cache(prompt_tokens, model_key)
            finally:
                self._entries += [e for e in kept if id(e.cache) in held]
            if any(e.cache is out for e in self._entries):  # a new empty entry, not a copy
                return out
            return cut_to(out, usable_tokens(mounted, out, prompt_tokens, shelf))

        def put_cache(self, cache: Any) -> None:
            if warm_up.WARMING.is_set():  # the warm-up request leaves no entry
                return
            if snapshots is not None:  # evaluated on the generation thread that made it
                evaluate(cache.cache)
                cache.stamp = snapshots.tick()
            with PinnedPromptCachePool.lock:
                super().put_cache(cache)
                PinnedPromptCachePool.instances[id(self)] = self
                if snapshots is not None:  # the spill's capture, on the thread that stored
                    snapshots.changed()

    return PinnedPromptCachePool


def usable_tokens(mounted: Mounted, entry: Any, prompt: list[int], snapshots: Any = None) -> int:
    """How many leading tokens of `prompt` omni's `entry` (`.tokens`, `.cache`) may serve (0:
    none): those its KV holds for them, at least one token left, cut only where every layer
    trims; a lossy entry, or one sharing its opening with a lossy bundle or restored snapshot,
    only for its share (omni would hand a refused one out trimmed to 0 and prefill into it)."""
    held = held_offset(entry.cache)
    if held is None:
        return 0
    tokens = entry.tokens[:held]
    n = min(len(tokens), len(prompt) - 1)
    n = next((i for i in range(n) if tokens[i] != prompt[i]), n)
    if n < held and not all(layer.is_trimmable() for layer in entry.cache):
        return 0
    floor = mounted.manager.lossy_floor(BUNDLE_KEY, prompt, entry.cache, len(tokens))
    floor = max(floor, snapshots.lossy_floor(prompt) if snapshots is not None else 0)
    return n if n >= max(1, floor) else 0


def entry_usable(mounted: Mounted, entry: Any, prompt: list[int], snapshots: Any = None) -> bool:
    """True when the one rule lets `prompt` take any of omni's `entry`."""
    return usable_tokens(mounted, entry, prompt, snapshots) > 0


def cut_to(checkout: Any, n: int) -> Any:
    """omni's checked-out copy holding KV for exactly its first `n` tokens (n >= 1: omni then
    continues the rest of the prompt from there), or a new empty one for n == 0."""
    from mlx_omni_server.chat.mlx.prompt_cache import PromptCache

    if n == 0:
        return PromptCache()
    held = held_offset(checkout.cache)
    cache = fork_cache(checkout.cache, held - n) if held != n else checkout.cache
    return PromptCache(list(checkout.tokens[:n]), cache, checkout.model_key)


__all__ = ["cut_to", "entry_usable", "model_folder", "pinned_pool_class", "usable_tokens"]
