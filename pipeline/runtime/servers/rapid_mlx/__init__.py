"""`serve --server rapid-mlx`: rapid-mlx 0.16 (a vllm-mlx fork; its BatchedEngine is its only
engine) with bundles pinned in its scheduler's prefix cache.

rapid-mlx's scheduler keeps a `MemoryAwarePrefixCache` (the interface of vllm-mlx's, with a
radix index) and looks every admitted request up in it; the hook puts a subclass there whose
fetch also answers from the pinned bundles through the one lookup rule (batched path: mergeable
copies; the bundles stay outside its LRU, memory limit and subset eviction). With
`--use-paged-cache` it keeps a paged `BlockAwarePrefixCache` instead: the bundles enter it as its
blocks (paged_cache.py, shared with vllm-mlx). rapid-mlx reports
the scheduler's `cached_tokens` in its usage itself. Its own prefix-cache persistence (restore
at startup, save at shutdown, `RAPID_MLX_PREFIX_CACHE_AUTOLOAD`) is off under serve, and its
`POST /v1/cache/import` is refused: neither may serve a request from a cache the validator has
not seen.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from pipeline.runtime.servers import warm_up
from pipeline.runtime.servers.hook import SERVING, ServerHook
from pipeline.runtime.servers.mounted import Mounted
from pipeline.runtime.servers.options import ServeOptions
from pipeline.runtime.servers.paged_cache import install_batched_cache, refused_with

log = logging.getLogger("prefix-bundles")
SERVER = "rapid-mlx"
REFUSED_ROUTES = ("/v1/cache/import",)


class Hook(ServerHook):
    name, package, address, snapshots = SERVER, "rapid_mlx", ("127.0.0.1", 8000), True
    distribution, extra = "rapid-mlx==0.16.10", "rapid-mlx"
    serving = (  # its text serving path (not torch, torchvision, opencv, mlx-vlm, mflux)
        *SERVING[:9], "tiktoken", "pyyaml", "tomli-w", "rich", "tabulate", "jsonschema",
        "referencing", "argcomplete", "websockets", "mcp", *SERVING[9:],
    )  # fmt: skip
    proves = ("rapid_mlx.cli", "rapid_mlx.scheduler", "rapid_mlx.server")
    ships = ("rapid_mlx", "vllm_mlx")  # a vllm_mlx package of its own
    reads = ("--api-key", "--use-paged-cache")
    messages_route = True
    plain = ("rapid-mlx", "serve", "{model}")
    unsupported = {
        "--models-config": "serve mounts bundles for the one model folder given as --model",
        "--mllm": "bundles hold text-model caches; multimodal routing is not hooked",
        "--no-memory-aware-cache": "its legacy prefix cache is not hooked; bundles answer through "
        "the default memory-aware prefix cache",
        "--disable-prefix-cache": "with no prefix cache rapid-mlx looks nothing up, bundles included",
    }
    # request_ids: none to call (it renders inline in its route); warm-up checks its ids through its app

    def refused(self, options: ServeOptions) -> dict[str, str]:
        return {**self.unsupported, **refused_with(options)}

    def install(self, mounted: Mounted, options: ServeOptions, snapshots: Any = None) -> None:
        """Patch rapid-mlx's scheduler cache; its persistence off, its cache import refused."""
        from rapid_mlx import scheduler, server

        paged_module = "rapid_mlx.paged_cache"
        self.listed = install_batched_cache(
            scheduler, paged_module, mounted, SERVER, options.rest, snapshots
        )
        server._automatic_prefix_cache_persistence_enabled = lambda: False
        log.info(
            "%s: its own on-disk prefix cache is neither restored nor saved under serve (not "
            "checked by the validator: identified by model name, KV dtype and file metadata, not "
            "weights or template)",
            SERVER,
        )
        refuse_cache_import(server.app)
        if snapshots is not None:  # it os._exit()s after its graceful stop: serve saves first
            from rapid_mlx import cli

            cli._hard_exit_after_serve = lambda: None

    def warm_up_server(self, mounted: Mounted, options: ServeOptions) -> None:
        from rapid_mlx import server

        warm_up.through_vllm_app(server, SERVER, mounted, options, self.clients_send(options))

    def launch(self, mounted: Mounted, options: ServeOptions) -> int:
        from rapid_mlx.cli import main

        sys.argv = ["rapid-mlx", "serve", str(options.model), *options.rest]
        main()
        return 0

    def entries(self, mounted: Mounted, snapshots: Any) -> list[Any]:
        return self.listed(mounted, snapshots)


def refuse_cache_import(app: Any) -> None:
    """POST /v1/cache/import would put unvalidated entries in the cache requests are served from."""
    from starlette.responses import JSONResponse

    @app.middleware("http")
    async def no_import(request: Any, call_next: Any) -> Any:
        if request.url.path in REFUSED_ROUTES:
            message = (
                "refused under serve: imported cache entries are not checked by the validator; "
                "deploy prefix bundles instead (docs/servers.md)"
            )
            return JSONResponse({"error": {"message": message, "type": "forbidden"}}, 403)
        return await call_next(request)
