"""`serve --server mlx-openai-server`: mlx-openai-server 1.8.1 with bundles pinned in the prompt cache
of the process that serves the model.

mlx-openai-server runs each model's handler in a child process started with `spawn`, and the
handler builds an mlx-lm-style `LRUPromptCache` (app.utils.prompt_cache) there. A patch in the
parent does not reach the child, so the parent validates the bundles (logs, --strict) and swaps
the child's entry point (`app.core.handler_process._handler_worker`, looked up when the child is
started) for `child_worker`: in the child it mounts the bundles again with the same options, puts
a subclass in place of `LRUPromptCache` whose lookups also answer from them, then runs the
original entry point.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from pipeline.runtime.lookup import lookup
from pipeline.runtime.servers import warm_up
from pipeline.runtime.servers.startup import (
    BUNDLE_KEY,
    Mounted,
    check_tokenization,
    mount_for,
    passed_option,
    refuse_options,
    require,
    setup_logging,
    start,
)

log = logging.getLogger("prefix-bundles")
SERVER = "mlx-openai-server"
ADDRESS = ("0.0.0.0", 8000)  # where it binds when its options do not say
ENV = "PREFIX_BUNDLES_OPENAI_MOUNT"  # serve's mount options, JSON, for the spawned child
UNSUPPORTED = {
    "--config": "serve mounts bundles for the one model folder given as --model",
    "--model-path": "serve passes --model as mlx-openai-server's --model-path",
}


def pinned_cache_class(mounted: Mounted) -> type:
    """mlx-openai-server's LRUPromptCache, answering from the pinned bundles when they cover more."""
    from app.utils.prompt_cache import LRUPromptCache

    class PinnedPromptCache(LRUPromptCache):
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
            return lookup(SERVER, mounted.manager, BUNDLE_KEY, tokens_ids, fetch, batched=True)

    return PinnedPromptCache


def install(mounted: Mounted) -> None:
    """The handler imports LRUPromptCache from its module when it is created: ours is there."""
    from app.utils import prompt_cache

    prompt_cache.LRUPromptCache = pinned_cache_class(mounted)


def child_worker(model_cfg: dict[str, Any], *rest: Any) -> None:
    """The spawned handler process: mount, install, then mlx-openai-server's own worker."""
    from pipeline.blas import ensure_fast_blas

    ensure_fast_blas()  # a spawned child imports mlx afresh: OpenBLAS first, as serve does
    from app.core import handler_process

    options = json.loads(os.environ[ENV])
    setup_logging(None)
    template, validated = options.pop("chat_template"), options.pop("validated")
    model = Path(options["model"])
    if Path(str(model_cfg.get("model_path", ""))).resolve() == model.resolve():
        options.update(model=model, bundles=Path(options["bundles"]))
        for key in ("lockfile", "admin_token_file"):
            if options[key] is not None:
                options[key] = Path(options[key])
        mounted = mount_for(argparse.Namespace(**options), template)
        keep_what_serve_validated(mounted, validated)
        install(mounted)
        log.info(
            "%s: %d bundle(s) pinned in the handler process %d",
            SERVER,
            len(mounted.result.bundles),
            os.getpid(),
        )
        # default off here, unlike on every other server: measured to make its first request
        # slower (bench case servers, n=3: 0.85 s with it, 0.70 s without); --warm-up runs it
        if options["warm_up"] is True:
            warm_up_handler(mounted, model_cfg.get("served_model_name") or str(model))
    handler_process._handler_worker(model_cfg, *rest)  # the child's module is not patched


def keep_what_serve_validated(mounted: Mounted, validated: dict[str, str]) -> None:
    """The handler process serves exactly what serve validated and reported ({bundle path: cache
    sha256}): a bundle that changed or appeared in between is unpinned with a WARNING (a remount
    takes it), one that is gone is named."""
    for b in list(mounted.result.bundles):
        if validated.get(str(b.path)) != b.manifest.cache.file_sha256:
            mounted.result.bundles.remove(b)
            mounted.manager.unpin(BUNDLE_KEY, b.name)
            log.warning(
                "%s: %s changed after serve validated it: not mounted in the handler process "
                "(SIGHUP or the admin endpoint mounts it)",
                SERVER,
                b.path,
            )
    mounted_paths = {str(b.path) for b in mounted.result.bundles}
    for path in sorted(set(validated) - mounted_paths):
        log.warning(
            "%s: %s was validated by serve but is gone from the handler process", SERVER, path
        )


def warm_up_handler(mounted: Mounted, model: str) -> None:
    """Once the handler has loaded the model, and before the child reports ready (the parent opens
    its port after): the longest bundle's request through the handler's own text path, the one
    the parent's chat route calls (servers/warm_up.py)."""
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
        await warm_up.run_logged(SERVER, [bundle], request)
        return ready

    MLXLMHandler.initialize = initialize


def run(args: argparse.Namespace, rest: list[str], argv: list[str]) -> int:
    """Validate here (logs, --strict), hand the options to the child, run mlx-openai-server."""
    require("app.handler.mlx_lm", SERVER)
    refuse_options(rest, SERVER, UNSUPPORTED)
    template_file = passed_option(rest, "--chat-template-file")
    template = Path(template_file).read_text() if template_file else None
    # the handler child serves from its own mount: SIGHUP and --admin-port are its (live)
    mounted = start(args, rest, argv, template, live=False)
    check_tokenization(SERVER, mounted)
    if args.warm_up is None:
        log.info(
            "%s: no warm-up by default (measured: its first request is slower with one); "
            "--warm-up runs it",
            SERVER,
        )
    options = {
        k: str(v) if isinstance(v, Path) else v
        for k, v in vars(args).items()
        if k
        in (
            "model",
            "bundles",
            "strict",
            "verify_full",
            "lockfile",
            "trusted_key",
            "admin_port",
            "admin_token_file",
            "warm_up",
        )
    }
    options["trusted_key"] = [str(p) for p in options.get("trusted_key") or []]
    options["chat_template"] = template
    # what this process validated and logged: the handler mounts exactly that
    options["validated"] = {
        str(b.path): b.manifest.cache.file_sha256 for b in mounted.result.bundles
    }
    os.environ[ENV] = json.dumps(options)
    del mounted  # the child mounts its own copy; this process only serves HTTP

    from app.core import handler_process

    handler_process._handler_worker = child_worker
    from app.cli import cli

    sys.argv = ["mlx-openai-server", "launch", "--model-path", str(args.model), *rest]
    cli()
    return 0
