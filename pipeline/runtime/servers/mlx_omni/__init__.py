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
from types import SimpleNamespace
from typing import Any

from pipeline.runtime.servers import usage, warm_up
from pipeline.runtime.servers.entries import held_entry
from pipeline.runtime.servers.hook import SERVING, ServerHook
from pipeline.runtime.servers.mlx_omni import pool
from pipeline.runtime.servers.mlx_omni.pool import SERVER, pinned_pool_class
from pipeline.runtime.servers.mounted import Mounted
from pipeline.runtime.servers.options import ServeOptions
from pipeline.runtime.servers.startup import hub_cache_or_none
from pipeline.runtime.servers.tokens import quiet


class Hook(ServerHook):
    name, package, address, snapshots = SERVER, "mlx_omni_server", ("0.0.0.0", 10240), True
    distribution, extra, serving = "mlx-omni-server==0.5.3", "mlx-omni-server", SERVING
    proves, ships = ("mlx_omni_server.chat.mlx.chat_generator",), ("mlx_omni_server",)
    reads = ("--workers",)
    plain = ("mlx-omni-server",)  # it loads the model a request names

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
        """Every pool's entries (once each) for the served folder, stamped at put_cache (under
        the pools' lock: a spill's capture runs while other requests use them)."""
        with self.pools.lock:
            pools = list(self.pools.instances.values())
            pooled = {id(e.cache): e.cache for p in pools for e in list(p._entries)}
        folder = mounted.model.resolve()
        ours = [c for c in pooled.values() if pool.model_folder(c.model_key) == folder]
        held = [(getattr(c, "stamp", 0), c.tokens, c.cache, f"{SERVER} prompt pool") for c in ours]
        return [e for e in (held_entry(*h, mounted, snapshots) for h in held) if e is not None]
