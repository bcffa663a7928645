"""`serve` (the default server): mlx_lm.server with bundles mounted before the first request is
accepted.

The hook replaces names in mlx_lm.server before its main() runs: `LRUPromptCache` (a subclass
answering from the mounted bundles and restored snapshots under the one lookup rule, handing the
batched path only caches it can merge), and through generation_thread.py `ModelProvider`
(warm-up, then the port opens) and `ResponseGenerator` (a dead generation thread ends the process;
a request whose sampling settings would kill that thread is refused alone; the prompt cache is
told which path fetches). Everything else (options, HTTP, generation) is mlx_lm.server's.
"""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace
from typing import Any

from pipeline.runtime.prompt_cache import at_least_one_left
from pipeline.runtime.servers.hook import ServerHook
from pipeline.runtime.servers.lru_cache import lru_entries, pinned_lru_class
from pipeline.runtime.servers.mlx_lm import generation_thread
from pipeline.runtime.servers.mounted import Mounted
from pipeline.runtime.servers.options import ServeOptions
from pipeline.runtime.servers.startup import hub_cache_or_none
from pipeline.runtime.snapshots import Snapshots

log = logging.getLogger("prefix-bundles")
SERVER = "mlx_lm.server"


class Hook(ServerHook):
    name, package, address, snapshots = "mlx-lm", "mlx_lm.server", ("127.0.0.1", 8080), True
    reads = ("--adapter-path", "--draft-model", "--kv-bits")
    plain = ("mlx_lm.server", "--model", "{model}")

    def refused(self, options: ServeOptions) -> dict[str, str]:
        if options.snapshots is None:
            return {}
        why = "the server's entries then belong to a model the snapshots do not record"
        return {
            "--adapter-path": f"with --snapshots: {why}",
            "--draft-model": f"with --snapshots: {why}",
        }

    def unusable(self, bundle: Any, options: ServeOptions) -> str | None:
        for option, what in (("--adapter-path", "an adapter"), ("--draft-model", "a draft model")):
            if options.passed(option):
                return (
                    f"{option} serves the model with {what}, whose prompt cache differs from the "
                    "bundle's (mlx_lm.server keys its cache by model, adapter and draft model)"
                )
        bits, built = options.passed("--kv-bits"), bundle.manifest.cache.kv_bits
        if bits is not None and built is not None and str(built) != bits:
            return (
                f"--kv-bits {bits} asks for {bits}-bit KV but the bundle holds {built}-bit KV, which "
                "mlx_lm would continue as it is (it never re-quantizes a quantized cache); build it "
                f"with kv_bits = {bits}, or without kv_bits so the server quantizes it"
            )
        return None

    @staticmethod
    def request_ids(tokenizer: Any, body: dict[str, Any], model_type: str) -> list[int]:
        from mlx_lm.server import ResponseGenerator  # its _tokenize, on stand-ins

        cli = SimpleNamespace(chat_template_args={})
        generator = SimpleNamespace(model_provider=SimpleNamespace(cli_args=cli, processor=None))
        request = SimpleNamespace(
            request_type="chat", messages=body["messages"], tools=body.get("tools"),
            role_mapping=body.get("role_mapping"),
        )  # fmt: skip
        args = SimpleNamespace(chat_template_kwargs=body.get("chat_template_kwargs"))
        return ResponseGenerator._tokenize(generator, tokenizer, request, args)[0]

    @staticmethod
    def encode_text(tokenizer: Any, text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    def install(self, mounted: Mounted, options: ServeOptions, snapshots: Any = None) -> None:
        import mlx_lm.server as server

        self.cache_class = bundled_prompt_cache_class(mounted, str(options.model), snapshots)
        server.LRUPromptCache = self.cache_class
        self.death, self.provider = generation_thread.install(server, mounted)
        server.scan_cache_dir = hub_cache_or_none(server.scan_cache_dir)

    def warm_up_server(self, mounted: Mounted, options: ServeOptions) -> None:
        # measured (bench case servers): first request / hit 1.35x without, 0.92x with
        self.provider.enabled = True

    def launch(self, mounted: Mounted, options: ServeOptions) -> int:
        import mlx_lm.server as server

        sys.argv = ["mlx_lm.server", "--model", str(options.model), *options.rest]
        try:
            server.main()
        except KeyboardInterrupt:
            if self.death.cause is None:
                raise
        if self.death.cause is not None:
            raise self.death.error()
        return 0

    def entries(self, mounted: Mounted, snapshots: Snapshots) -> list[Any]:
        if not self.cache_class.instances:
            return []
        key = (str(mounted.model), None, None)  # mlx_lm.server's key: (model, adapter, draft)
        return lru_entries(self.cache_class.instances[0], key, mounted, snapshots, SERVER)


def bundled_prompt_cache_class(mounted: Mounted, model_path: str, snapshots: Any = None) -> type:
    """mlx_lm.server's LRUPromptCache, also answering from the bundles pinned in `mounted` (and
    the restored `snapshots`); the batched path gets only caches it can merge."""
    from mlx_lm.server import LRUPromptCache

    class BundledPromptCache(pinned_lru_class(LRUPromptCache, mounted, snapshots, SERVER)):
        single_path = False  # True while the ResponseGenerator serves a request on its own

        def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[Any, list[int]]:
            fetch = lambda t: super(BundledPromptCache, self).fetch_nearest_cache(model, t)  # noqa: E731
            if model != (model_path, None, None) or not tokens:
                return at_least_one_left(fetch, tokens)
            return self.answer(tokens, fetch, batched=not self.single_path, key=model)[:2]

        def insert_cache(self, model: Any, tokens: list[int], *args: Any, **kwargs: Any) -> None:
            super().insert_cache(model, tokens, *args, **kwargs)
            self.stamped(tokens, args[0] if args else kwargs.get("prompt_cache"))

    return BundledPromptCache
