"""mlx-openai-server's model process, as serve runs it: each model's handler runs in a `spawn`
child, whose entry point serve swaps for `child_worker`: it mounts what serve validated (handed
down in ENV), restores the snapshots under the lock serve handed down, pins them in the handler's
LRUPromptCache (`pinned_cache_class`), warms the handler up, then runs the original worker."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pipeline.format.errors import PipelineError
from pipeline.runtime.servers import warm_up
from pipeline.runtime.servers.mlx_openai import handover
from pipeline.runtime.servers.mlx_openai.saving_cache import (
    deferred_lru_entries,
    saving_lru_class,
)
from pipeline.runtime.servers.mounted import Mounted
from pipeline.runtime.servers.registry import hook_for
from pipeline.runtime.servers.startup import mount_for, setup_logging
from pipeline.runtime.snapshots import child_snapshots

SERVER = handover.SERVER
ENV = "PREFIX_BUNDLES_OPENAI_MOUNT"  # serve's options and what it validated, for the child


def pinned_cache_class(mounted: Mounted, snapshots: Any = None) -> type:
    """mlx-openai-server's LRUPromptCache, answering from bundles and snapshots that cover more."""
    from app.utils.prompt_cache import LRUPromptCache

    class PinnedPromptCache(saving_lru_class(LRUPromptCache, mounted, snapshots, SERVER)):
        warmed_up = False  # entries of the warm-up request to drop at the first client's lookup

        def fetch_nearest_cache(
            self, tokens_ids: list[int], *, allowed_sources: set[str] | None = None
        ) -> tuple[list[Any] | None, list[int]]:
            if warm_up.WARMING.is_set():
                type(self).warmed_up = True
            elif type(self).warmed_up:
                # its batch scheduler stores a finished request's cache on its own thread, after
                # the response: whatever the cache holds before the first client is the warm-up's
                type(self).warmed_up = False
                self.clear()
            own = super().fetch_nearest_cache
            fetch = lambda t: own(t, allowed_sources=allowed_sources)  # noqa: E731
            # its handler generates through mlx-lm's BatchGenerator, which merges every layer
            return self.answer(tokens_ids, fetch, batched=True)[:2]

    return PinnedPromptCache


def child_worker(model_cfg: dict[str, Any], *rest: Any) -> None:
    """The spawned handler process: mount, install, then mlx-openai-server's own worker."""
    from pipeline.blas import ensure_fast_blas

    ensure_fast_blas()  # a spawned child imports mlx afresh: OpenBLAS first, as serve does
    from app.core import handler_process  # the child's module: its original entry point

    setup_logging(None)
    handed = json.loads(os.environ[ENV])
    options = handover.options_from_json(handed["options"])
    if Path(str(model_cfg.get("model_path", ""))).resolve() == options.model.resolve():
        from app.utils import prompt_cache  # the handler takes LRUPromptCache from there

        with handover.refusals_end_serve():  # one `error:` line, serve exits 1
            stop = handover.stop_parent  # its admin endpoint runs here: the stop is serve's
            mounted = mount_for(options, handed["template"], stop=stop)
            where = f"the handler process {os.getpid()}"
            handover.keep_validated(mounted, handed["validated"], where)
            snapshots = child_snapshots(options, mounted, hook_for(SERVER), handed.get("lock"))
        prompt_cache.LRUPromptCache = cache_class = pinned_cache_class(mounted, snapshots)
        if snapshots is not None and options.snapshot_every:  # spilled while it serves
            listing = lambda: spilled(cache_class, mounted, snapshots)  # noqa: E731
            snapshots.spill_while_serving(options.snapshot_every, listing, mounted.covered)
        if options.warm_up:
            warm_up_handler(mounted, model_cfg.get("served_model_name") or str(options.model))
    handler_process._handler_worker(model_cfg, *rest)


def spilled(cache_class: type, mounted: Mounted, snapshots: Any) -> list:
    """Its cache's entries for a spill, listed on the thread that stores them (their KV read on
    the spill thread); PipelineError (nothing spilled) once what it runs is unknown."""
    if not mounted.loaded_as_fingerprinted():
        raise PipelineError("the model folder changed under serve: nothing is saved")
    caches = cache_class.instances[:1]  # one model per process: its handler's one cache
    return [e for c in caches for e in deferred_lru_entries(c, mounted, snapshots, SERVER)]


def warm_up_handler(mounted: Mounted, model: str) -> None:
    """Once the handler loaded the model, before the child reports ready: the longest bundle's
    request through the handler's own text path, the parent's chat route's (servers/warm_up.py)."""
    from app.handler.mlx_lm import MLXLMHandler
    from app.schemas.openai import ChatCompletionRequest

    bundle = warm_up.longest_recorded(mounted)
    if bundle is None:
        return
    original = MLXLMHandler.initialize

    async def initialize(self: Any, *args: Any, **kwargs: Any) -> Any:
        ready = await original(self, *args, **kwargs)
        body = warm_up.body_of(bundle, model, "openai")
        request = lambda: self.generate_text_response(ChatCompletionRequest(**body))  # noqa: E731
        # its scheduler may store the warm-up's entry after the response: hand-outs count
        await warm_up.run_logged(SERVER, mounted, [bundle], request, keeps_nothing=False)
        return ready

    MLXLMHandler.initialize = initialize


__all__ = ["ENV", "child_worker", "pinned_cache_class", "warm_up_handler"]
