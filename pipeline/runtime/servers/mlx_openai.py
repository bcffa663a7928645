"""`serve --server mlx-openai-server`: mlx-openai-server 1.8.1, bundles pinned in its model process.

Each model's handler runs in a `spawn` child building an mlx-lm-style `LRUPromptCache`: the
parent validates the bundles, locks --snapshots DIR (handed to the child), and swaps the child's
entry point for `child_worker`: it mounts what the parent validated and the snapshots (saved as
its handler closes the cache at the graceful stop), pins them, then runs the original one."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pipeline.runtime.servers import startup, warm_up
from pipeline.runtime.servers.hook import ServerHook
from pipeline.runtime.servers.lru_cache import saving_lru_class
from pipeline.runtime.servers.mounted import BUNDLE_KEY, Mounted
from pipeline.runtime.servers.options import ServeOptions
from pipeline.runtime.snapshots import child_snapshots, parent_of_snapshots

SERVER = "mlx-openai-server"
ENV = "PREFIX_BUNDLES_OPENAI_MOUNT"  # serve's options and what it validated, for the child


class Hook(ServerHook):
    name, package, address, snapshots = SERVER, "app.handler.mlx_lm", ("0.0.0.0", 8000), True
    unsupported = {
        "--config": "serve mounts bundles for the one model folder given as --model",
        "--model-path": "serve passes --model as mlx-openai-server's --model-path",
    }
    # measured to make its first request slower (bench case servers, n=3: 0.85 s with it, 0.70 s
    # without): off by default here; it runs in the model process (options.warm_up travels along)
    warm_up, live = False, False  # live: the model process serves the mount (SIGHUP, snapshots)

    def chat_template(self, options: ServeOptions) -> str | None:
        path = options.passed("--chat-template-file")
        return Path(path).read_text() if path else None

    @staticmethod
    def request_ids(tokenizer: Any, body: dict[str, Any], model_type: str) -> list[int]:
        from app.handler.mlx_lm import MLXLMHandler
        from app.models.mlx_lm import MLX_LM
        from app.schemas.openai import ChatCompletionRequest

        body.setdefault("model", "model")
        handler = MLXLMHandler.__new__(MLXLMHandler)  # its methods, none of its model or workers
        handler.__dict__.update(kv_bits=None, kv_group_size=64, quantized_kv_start=0)
        handler.__dict__.update(message_converter=None, _disable_batching=True)
        prepare = MLXLMHandler._prepare_text_request(handler, ChatCompletionRequest(**body))
        messages, params = asyncio.run(prepare)
        messages = MLXLMHandler.refine_messages(handler, messages)
        model = SimpleNamespace(tokenizer=tokenizer)
        kwargs = params.get("chat_template_kwargs", {})
        return MLX_LM.encode_prompt(model, MLX_LM.create_input_prompt(model, messages, kwargs))

    def install(self, mounted: Mounted, options: ServeOptions, snapshots: Any = None) -> None:
        """The model process mounts exactly what this one validated and logged (`validated`)."""
        from app.core import handler_process

        lock = parent_of_snapshots(options)  # --snapshots: held here, handed to the model process
        handed = {"options": options.to_json(), "template": mounted.chat_template, "lock": lock}
        os.environ[ENV] = json.dumps({**handed, "validated": mounted.validated()})
        handler_process._handler_worker = child_worker
        startup.exit_on_refusal()
        for b in mounted.result.bundles:  # this process only serves HTTP: the child has its own
            mounted.manager.unpin(BUNDLE_KEY, b.name)

    def launch(self, mounted: Mounted, options: ServeOptions) -> int:
        from app.cli import cli

        model = ["--model-path", str(options.model)]
        sys.argv = ["mlx-openai-server", "launch", *model, *options.rest]
        cli()
        return 0


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

    startup.setup_logging(None)
    handed = json.loads(os.environ[ENV])
    options = ServeOptions.from_json(handed["options"])
    if Path(str(model_cfg.get("model_path", ""))).resolve() == options.model.resolve():
        from app.utils import prompt_cache  # the handler takes LRUPromptCache from there

        with startup.refusals_end_serve():  # one `error:` line, serve exits 1
            mounted = startup.mount_for(options, handed["template"])
            where, validated = f"the handler process {os.getpid()}", handed["validated"]
            mounted.keep_validated(validated, SERVER, where)
            snapshots = child_snapshots(options, mounted, Hook(), handed.get("lock"))
        prompt_cache.LRUPromptCache = pinned_cache_class(mounted, snapshots)
        if options.warm_up:
            warm_up_handler(mounted, model_cfg.get("served_model_name") or str(options.model))
    handler_process._handler_worker(model_cfg, *rest)


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
