"""`serve --server vllm-mlx`: vllm-mlx 0.6.0 with bundles pinned in the prompt cache of the
engine its options run: SimpleEngine (its default: a prefix trie and system-prompt snapshots,
simple_engine.py) or, with `--continuous-batching`, BatchedEngine (its scheduler's
memory-aware prefix cache, memory_cache.py, or with `--use-paged-cache` its paged
BlockAwarePrefixCache, paged_cache.py: both shared with rapid-mlx). vllm-mlx's own on-disk prefix
cache is neither loaded nor written under serve.
"""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace
from typing import Any

from pipeline.runtime.servers import usage, warm_up
from pipeline.runtime.servers.hook import SERVING, ServerHook
from pipeline.runtime.servers.mounted import Mounted
from pipeline.runtime.servers.options import ServeOptions
from pipeline.runtime.servers.paged_cache import install_batched_cache, refused_with
from pipeline.runtime.servers.tokens import is_anthropic
from pipeline.runtime.servers.vllm_mlx import simple_engine, usage_binding

log = logging.getLogger("prefix-bundles")
SERVER = "vllm-mlx"
BATCHED_UNSUPPORTED = {  # with --continuous-batching: prefix caches other than the ones hooked
    "--no-memory-aware-cache": "its legacy PrefixCacheManager is not hooked; bundles answer "
    "through the default memory-aware prefix cache",
    "--disable-prefix-cache": "with no prefix cache vllm-mlx looks nothing up, bundles included",
}


class Hook(ServerHook):
    name, package, address, snapshots = SERVER, "vllm_mlx", ("127.0.0.1", 8000), True
    distribution, extra, serving = "vllm-mlx==0.6.0", "vllm-mlx", SERVING
    proves, ships = ("vllm_mlx.cli", "vllm_mlx.server"), ("vllm_mlx",)
    reads = ("--api-key", "--continuous-batching", "--max-kv-size", "--use-paged-cache")
    reads += (*simple_engine.CACHE_OFF,)
    messages_route = True
    plain = ("vllm-mlx", "serve", "{model}")
    unsupported = {
        "--models-config": "serve mounts bundles for the one model folder given as --model",
        "--mllm": "bundles hold text-model caches; multimodal routing is not hooked",
    }

    def refused(self, options: ServeOptions) -> dict[str, str]:
        with_batching = {
            k: f"with --continuous-batching, {v}" for k, v in BATCHED_UNSUPPORTED.items()
        }
        if not batched(options):
            return self.unsupported
        return {**self.unsupported, **with_batching, **refused_with(options)}

    def unusable(self, bundle: Any, options: ServeOptions) -> str | None:
        if not batched(options):
            return simple_engine.unusable_reason(options.model, options.rest)
        if options.passed("--max-kv-size"):
            return (
                "--max-kv-size: with --continuous-batching vllm-mlx's scheduler bounds the KV in "
                "RotatingKVCache layers and discards a restored KVCache (its "
                "_restored_cache_matches_kv_bound), so it would prefill every request in full"
            )
        return None

    @staticmethod
    def request_ids(tokenizer: Any, body: dict[str, Any], model_type: str) -> list[int]:
        from vllm_mlx import server
        from vllm_mlx.api.tool_calling import convert_tools_for_template
        from vllm_mlx.engine.simple import SimpleEngine

        request = vllm_request(body)
        engine = SimpleNamespace(is_mllm=False, preserve_native_tool_format=False)
        messages = server._prepare_chat_messages(engine, request.messages)[0]
        tools = None
        if request.tools and request.tool_choice != "none":
            tools = convert_tools_for_template(request.tools)
        stand_in = SimpleNamespace(_model=SimpleNamespace(tokenizer=tokenizer), _model_name="model")
        kwargs = dict(request.chat_template_kwargs or {})
        prompt = SimpleEngine._render_chat_prompt(stand_in, messages, tools, kwargs, None)[0]
        return simple_engine.encode_prompt(tokenizer, prompt)

    @staticmethod
    def encode_text(tokenizer: Any, text: str) -> list[int]:
        return simple_engine.encode_prompt(tokenizer, text)

    def install(self, mounted: Mounted, options: ServeOptions, snapshots: Any = None) -> None:
        from vllm_mlx import server

        keep_own_disk_cache_off(server)
        if batched(options):
            from vllm_mlx import scheduler
            from vllm_mlx.engine_core import EngineCore

            paged_module = "vllm_mlx.paged_cache"
            self.listed = install_batched_cache(
                scheduler, paged_module, mounted, SERVER, options.rest, snapshots
            )
            usage_binding.bind_requests(EngineCore, scheduler.Scheduler)
        else:
            self.listed = simple_engine.install(mounted, snapshots)
        usage.add_middleware(server.app)

    def warm_up_server(self, mounted: Mounted, options: ServeOptions) -> None:
        from vllm_mlx import server

        undo = None if batched(options) else simple_engine.leave_no_system_snapshot(server)
        model = self.clients_send(options)
        warm_up.through_vllm_app(server, SERVER, mounted, options, model, undo)

    def launch(self, mounted: Mounted, options: ServeOptions) -> int:
        from vllm_mlx.cli import main

        sys.argv = ["vllm-mlx", "serve", str(options.model), *options.rest]
        main()
        return 0

    def entries(self, mounted: Mounted, snapshots: Any) -> list[Any]:
        return self.listed(mounted, snapshots)


def batched(options: ServeOptions) -> bool:
    """--continuous-batching: its BatchedEngine (scheduler and memory-aware prefix cache)."""
    return "--continuous-batching" in options.rest


def vllm_request(body: dict[str, Any]) -> Any:
    """vllm-mlx's ChatCompletionRequest for a body, an Anthropic one through its own converter."""
    from vllm_mlx.api.models import ChatCompletionRequest

    body = {"model": "model", **body}
    if not is_anthropic(body):
        return ChatCompletionRequest(**body)
    from vllm_mlx.api.anthropic_adapter import anthropic_to_openai
    from vllm_mlx.api.anthropic_models import AnthropicRequest

    return anthropic_to_openai(AnthropicRequest(**{"max_tokens": 1, **body}))


def keep_own_disk_cache_off(server: Any) -> None:
    """vllm-mlx loads its own persisted prefix cache at startup (~/.cache/vllm-mlx/prefix_cache,
    identified by model revision and library versions, not by weights, tokenizer or template)
    and writes it back at shutdown. Under serve neither happens: no request is served from a cache
    the validator has not seen, and nothing derived from a bundle is written where a plain
    vllm-mlx run would load it unchecked."""

    async def not_loaded(*args: Any, **kwargs: Any) -> None:
        log.info(
            "%s: its own on-disk prefix cache is not loaded under serve (it is not checked by the "
            "validator: identified by model revision and versions, not weights or template)",
            SERVER,
        )

    async def not_saved(*args: Any, **kwargs: Any) -> None:
        log.info("%s: its own on-disk prefix cache is not written under serve", SERVER)

    server._load_prefix_cache_from_disk = not_loaded
    server._save_prefix_cache_to_disk = not_saved
