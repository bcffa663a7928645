"""`serve --server mlx-omni-server`: mlx-omni-server 0.5.3 with bundles pinned in its prompt pool.

Each of omni's ChatGenerators creates a `PromptCachePool` lazily (8 entries, longest-common-prefix
scan, 300 s idle eviction) and checks out a copy per request. The hook replaces that class with a
subclass whose checkout also considers the pinned bundles: they are kept outside the pool's entry
list, so its TTL and size eviction never see them. Omni loads a model on the first request that
names it; a request reaches the bundles when its `model` names the folder they were validated
against (a path, relative to the server's working directory or absolute, or a hub id whose local
snapshot is that folder).
"""

from __future__ import annotations

import logging
import sys
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pipeline.runtime.servers import warm_up
from pipeline.runtime.servers.hook import ServerHook
from pipeline.runtime.servers.options import ServeOptions
from pipeline.runtime.servers.startup import BUNDLE_KEY, Mounted, hub_cache_or_none, log_request
from pipeline.runtime.servers.tokens import quiet

log = logging.getLogger("prefix-bundles")
SERVER = "mlx-omni-server"


class Hook(ServerHook):
    name, package, address = SERVER, "mlx_omni_server", ("0.0.0.0", 10240)

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

        prompt_cache_pool.PromptCachePool = pinned_pool_class(mounted)
        # its /v1/models lists the hub cache, and fails on a host that has none
        models_service.scan_cache_dir = hub_cache_or_none(models_service.scan_cache_dir)

    def warm_up_server(self, mounted: Mounted, options: ServeOptions) -> None:
        """Before the port opens: omni loads the model (it would on the first request naming it)
        and runs the longest bundle's request through its chat route. The request names the model
        as --model gives it; a client spelling the folder differently gets a ChatGenerator of its
        own from omni, loaded on its first request."""
        warm_up.through_app(self._app(), SERVER, mounted, lambda: str(options.model))

    def launch(self, mounted: Mounted, options: ServeOptions) -> int:
        from mlx_omni_server.main import start

        sys.argv = ["mlx-omni-server", *options.rest]
        start()
        return 0

    def _app(self) -> Any:
        from mlx_omni_server.main import app

        return app


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


def entry_usable(mounted: Mounted, entry: Any, prompt_tokens: list[int]) -> bool:
    """The one rule for an entry of omni's own pool: an entry holding lossy KV (or sharing its
    opening with a lossy bundle) only for its share (omni would hand it out trimmed, even to 0
    tokens, and prefill the prompt into its quantized layers)."""
    layers = entry.cache if isinstance(entry.cache, list) else []
    covered = next(
        (i for i, (a, b) in enumerate(zip(entry.tokens, prompt_tokens, strict=False)) if a != b),
        min(len(entry.tokens), len(prompt_tokens)),
    )
    floor = mounted.manager.lossy_floor(BUNDLE_KEY, prompt_tokens, layers, len(entry.tokens))
    return covered >= floor


def pinned_pool_class(mounted: Mounted) -> type:
    """omni's PromptCachePool, answering from the pinned bundles when they cover more."""
    from mlx_omni_server.chat.mlx.prompt_cache import PromptCache, common_prefix_len
    from mlx_omni_server.chat.mlx.prompt_cache_pool import PromptCachePool

    folder = mounted.model.resolve()

    class PinnedPromptCachePool(PromptCachePool):
        def get_cache(self, prompt_tokens: list[int], model_key: str) -> Any:
            if model_folder(model_key) != folder:
                return super().get_cache(prompt_tokens, model_key)
            self._evict_expired()
            ours = [e for e in self._entries if e.cache.model_key == model_key]
            held = [e for e in ours if not entry_usable(mounted, e.cache, prompt_tokens)]
            own = max(
                (common_prefix_len(e.cache.tokens, prompt_tokens) for e in ours if e not in held),
                default=0,
            )
            hit = mounted.manager.fetch(BUNDLE_KEY, prompt_tokens)
            if log_request(SERVER, hit, len(prompt_tokens), own):
                # a checkout omni extends by the rest of the prompt, then returns to the pool
                kept = list(prompt_tokens[: hit.cache_hit_tokens])
                return PromptCache(tokens=kept, cache=hit.cache, model_key=model_key)
            # omni's own checkout over the entries the one rule allows for this prompt; the
            # others stay in the pool for prompts that take enough of them
            self._entries = [e for e in self._entries if e not in held]
            try:
                return super().get_cache(prompt_tokens, model_key)
            finally:
                self._entries += [e for e in held if e not in self._entries]

        def put_cache(self, cache: Any) -> None:
            if not warm_up.WARMING.is_set():  # the warm-up request leaves no entry
                super().put_cache(cache)

    return PinnedPromptCachePool
