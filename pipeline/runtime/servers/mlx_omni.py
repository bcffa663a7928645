"""`serve --server mlx-omni-server`: mlx-omni-server 0.5.3 with bundles pinned in its prompt pool.

Each of omni's ChatGenerators creates a `PromptCachePool` lazily (8 entries, longest-common-prefix
scan, 300 s idle eviction) and checks out a copy per request. The hook's subclass also considers
the pinned bundles and restored snapshots, kept outside the pool's entry list (its TTL and size
eviction never see them), and lists its own entries at a graceful stop. omni's own entries hold
KV one token ahead of their tokens (it feeds the finishing token and does not record it), and it
re-feeds the last token of an exact hit: every checkout is cut here to the tokens the rule lets
the request keep, which omni then continues. Omni loads a model on the
first request naming it; a request reaches the bundles when its `model` names their folder (a
path, relative or absolute, or a hub id whose local snapshot is that folder)."""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pipeline.runtime.prompt_cache import fork_cache
from pipeline.runtime.servers import usage, warm_up
from pipeline.runtime.servers.hook import ServerHook
from pipeline.runtime.servers.lru_cache import evaluate, held_entry, held_offset
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
    from mlx_omni_server.chat.mlx.prompt_cache import PromptCache
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
            super().put_cache(cache)
            PinnedPromptCachePool.instances[id(self)] = self

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
