"""mlx-omni-server's own chat route (its OpenAI router, ChatGenerator and PromptCachePool) behind
`serve --server mlx-omni-server`'s preparation, with its models route, served by uvicorn: omni's full app does not import
on Linux (its image and audio routes need mflux and misaki), so the tests serve the chat part.

  omni_chat_app.py SERVE-ARGS... --port P
  e.g. omni_chat_app.py --bundles B serve --server mlx-omni-server --model M --port 8000
"""

from __future__ import annotations

import sys
import types


def main() -> None:
    from pipeline.blas import ensure_fast_blas

    ensure_fast_blas(sys.argv[1:])
    import uvicorn
    from fastapi import FastAPI
    from mlx_omni_server.chat.openai.models.models import router as models_router
    from mlx_omni_server.chat.openai.router import router

    from pipeline.cli import parse_args
    from pipeline.runtime.servers.mlx_omni import Hook
    from pipeline.runtime.servers.options import ServeOptions
    from pipeline.runtime.servers.startup import serve

    app = FastAPI()
    app.include_router(router)
    app.include_router(models_router)
    app.get("/health")(lambda: {"status": "ok"})
    main_module = types.ModuleType("mlx_omni_server.main")  # where the hook imports omni's app
    main_module.app = app
    sys.modules[main_module.__name__] = main_module

    class ChatRoute(Hook):
        """omni's hook, serving this chat-only app instead of omni's whole one."""

        def launch(self, mounted: object, options: ServeOptions) -> int:
            port = int(options.passed("--port") or 10240)  # omni's default port
            uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
            return 0

    args = parse_args(sys.argv[1:])
    hook = ChatRoute()
    serve(hook, ServeOptions.from_args(args, args.passthrough, sys.argv[1:], hook))


if __name__ == "__main__":
    main()
