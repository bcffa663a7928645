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

from pipeline.runtime.servers.hook import SERVING, ServerHook
from pipeline.runtime.servers.mlx_openai import handover
from pipeline.runtime.servers.mlx_openai.model_process import ENV, SERVER, child_worker
from pipeline.runtime.servers.mounted import BUNDLE_KEY, Mounted
from pipeline.runtime.servers.options import ServeOptions
from pipeline.runtime.snapshots import parent_of_snapshots


class Hook(ServerHook):
    name, package, address, snapshots = SERVER, "app.handler.mlx_lm", ("0.0.0.0", 8000), True
    distribution, extra = "mlx-openai-server==1.8.1", "mlx-openai-server"
    # its handler imports outlines, which imports torch: the CPU wheel
    serving = (*SERVING, "outlines>=1.1.1,<1.2", "torch==2.13.0")
    proves = ("app.handler.mlx_lm", "app.utils.prompt_cache", "outlines.processors")
    ships, reads = ("app",), ("--chat-template-file",)
    plain = ("mlx-openai-server", "launch", "--model-path", "{model}")
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
        options_json = handover.options_json(options)
        handed = {"options": options_json, "template": mounted.chat_template, "lock": lock}
        os.environ[ENV] = json.dumps({**handed, "validated": handover.validated(mounted)})
        handler_process._handler_worker = child_worker
        handover.exit_on_refusal()
        for b in mounted.result.bundles:  # this process only serves HTTP: the child has its own
            mounted.manager.unpin(BUNDLE_KEY, b.name)

    def launch(self, mounted: Mounted, options: ServeOptions) -> int:
        from app.cli import cli

        model = ["--model-path", str(options.model)]
        sys.argv = ["mlx-openai-server", "launch", *model, *options.rest]
        cli()
        return 0
