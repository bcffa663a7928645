"""`serve --server mlx-omni-server`: mlx-omni-server 0.5.3 with bundles pinned in its prompt pool.

Each of omni's ChatGenerators creates a `PromptCachePool` lazily (8 entries, longest-common-prefix
scan, 300 s idle eviction) and checks out a copy per request. The hook's subclass also considers
the pinned bundles and restored snapshots, kept outside the pool's entry list (its TTL and size
eviction never see them), and lists its own entries at a graceful stop. Omni loads a model on the
first request naming it; a request reaches the bundles when its `model` names their folder (a
path, relative or absolute, or a hub id whose local snapshot is that folder)."""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pipeline.runtime.servers import usage, warm_up
from pipeline.runtime.servers.hook import ServerHook
from pipeline.runtime.servers.lru_cache import entry_usable, evaluate, held_entry
from pipeline.runtime.servers.mounted import BUNDLE_KEY, Mounted
from pipeline.runtime.servers.options import ServeOptions
from pipeline.runtime.servers.startup import hub_cache_or_none, log_request
from pipeline.runtime.servers.tokens import quiet
from pipeline.runtime.snapshots import snapshot_answer

SERVER = "mlx-omni-server"


class Hook(ServerHook):
    name, package, address, snapshots = SERVER, "mlx_omni_server", ("0.0.0.0", 10240), True

    def refused(self, options: ServeOptions) -> dict[str, str]:
        many = options.passed("--workers") not in (None, "1")
        return {"--workers": "each worker is a new process the hook does not reach"} if many else {}

    @staticmethod
    def request_ids(tokenizer: Any, body: dict[str, Any], model_type: str) -> list[int]:
        from mlx_omni_server.chat.mlx.chat_generator import ChatGenerator
        from mlx_omni_server.chat.mlx.tools.chat_template import ChatTemplate
        from mlx_omni_server.chat.openai.openai_adapter import OpenAIAdapter
        from mlx_omni_server.chat.openai.schema import ChatCompletionRequest

        body.setdefault("model", "model")
        if "chat_template_kwargs" in body:  # omni reads template kwargs from extra_body
            body["extra_body"] = body.pop("chat_template_kwargs")
        generator = SimpleNamespace(chat_template=ChatTemplate(model_type, tokenizer))
        with quiet("mlx_omni"):  # it logs every request's messages and tools
            params = OpenAIAdapter._prepare_generation_params(
                SimpleNamespace(_default_max_tokens=1), ChatCompletionRequest(**body)
            )
            prompt = ChatGenerator._prepare_prompt(
                generator, params["messages"], params["tools"], params["template_kwargs"]
            )
        return tokenizer.encode(prompt)

    def install(self, mounted: Mounted, options: ServeOptions, snapshots: Any = None) -> None:
        """Every ChatGenerator's pool (created lazily, looked up by module attribute) is ours."""
        from mlx_omni_server.chat.mlx import prompt_cache_pool
        from mlx_omni_server.chat.openai.models import models_service
        from mlx_omni_server.main import app

        usage.add_middleware(app, counts=False)  # its Anthropic input_tokens count the reads too
        self.pools = prompt_cache_pool.PromptCachePool = pinned_pool_class(mounted, snapshots)
        # its /v1/models lists the hub cache, and fails on a host that has none
        models_service.scan_cache_dir = hub_cache_or_none(models_service.scan_cache_dir)

    def warm_up_server(self, mounted: Mounted, options: ServeOptions) -> None:
        """Before the port opens: omni loads the model (it would on the first request naming it)
        and runs the longest bundle's request through its chat route. The request names the model
        as --model gives it; a client spelling the folder differently gets a ChatGenerator of its
        own from omni, loaded on its first request."""
        from mlx_omni_server.main import app

        warm_up.through_app(app, SERVER, mounted, lambda: str(options.model))

    def launch(self, mounted: Mounted, options: ServeOptions) -> int:
        from mlx_omni_server.main import start

        sys.argv = ["mlx-omni-server", *options.rest]
        start()
        return 0

    def entries(self, mounted: Mounted, snapshots: Any) -> list[Any]:
        """Every pool's entries (once each) for the served folder, stamped at put_cache."""
        pooled = {id(e.cache): e.cache for p in self.pools.instances.values() for e in p._entries}
        ours = [c for c in pooled.values() if model_folder(c.model_key) == mounted.model.resolve()]
        held = [(getattr(c, "stamp", 0), c.tokens, c.cache, f"{SERVER} prompt pool") for c in ours]
        return [e for e in (held_entry(*h, mounted, snapshots) for h in held) if e is not None]


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
    from mlx_omni_server.chat.mlx.prompt_cache import PromptCache, common_prefix_len
    from mlx_omni_server.chat.mlx.prompt_cache_pool import PromptCachePool

    folder = mounted.model.resolve()

    class PinnedPromptCachePool(PromptCachePool):
        instances: dict[int, Any] = {}  # every pool that kept an entry, listed at a graceful stop

        def get_cache(self, prompt_tokens: list[int], model_key: str) -> Any:
            if model_folder(model_key) != folder:
                return super().get_cache(prompt_tokens, model_key)
            self._evict_expired()
            fine = mounted.loaded_as_fingerprinted()  # else no bundle or snapshot answers
            shelf = snapshots if fine else None
            ours = [e.cache for e in self._entries if e.cache.model_key == model_key]
            held = {id(c) for c in ours if not entry_usable(mounted, c, prompt_tokens, shelf)}
            usable = [c.tokens for c in ours if id(c) not in held]
            own = max((common_prefix_len(t, prompt_tokens) for t in usable), default=0)
            hit = mounted.manager.fetch(BUNDLE_KEY, prompt_tokens if fine else [])
            better = max(own, hit.cache_hit_tokens)  # a snapshot answers only where it covers more
            found, keep, _ = snapshot_answer(shelf, prompt_tokens, better, SERVER)
            if found is None and log_request(SERVER, hit, len(prompt_tokens), own):
                found, keep = hit.cache, hit.cache_hit_tokens
            if found is not None:  # a checkout omni extends by the rest of the prompt, then returns
                return PromptCache(list(prompt_tokens[:keep]), found, model_key)
            kept = self._entries  # omni's own checkout over the entries the rule allows
            self._entries = [e for e in kept if id(e.cache) not in held]
            try:
                return super().get_cache(prompt_tokens, model_key)
            finally:
                self._entries += [e for e in kept if id(e.cache) in held]

        def put_cache(self, cache: Any) -> None:
            if warm_up.WARMING.is_set():  # the warm-up request leaves no entry
                return
            if snapshots is not None:  # evaluated on the generation thread that made it
                evaluate(cache.cache)
                cache.stamp = snapshots.tick()
            super().put_cache(cache)
            PinnedPromptCachePool.instances[id(self)] = self

    return PinnedPromptCachePool
