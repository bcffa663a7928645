"""What a wrapped server differs by, declared in one place: each hook module defines `Hook`, a
subclass of `ServerHook`, and the one start-up sequence (pipeline.runtime.servers.startup.serve)
calls its points in the order they are listed here, after its declarations (what server-env, the
option table and the tests read through pipeline.runtime.servers.registry). Everything else a
server's process runs (the options, the mount, the validator, the lookup rule, remount, the
tokenization check, snapshots) is shared and lives in pipeline.runtime.

A point a hook does not define keeps the default below. No point imports its server at module
import time: the server is imported when serve runs it (after `package` was found).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pipeline.runtime.servers.options import ServeOptions, passed_option


class ServerHook:
    """The declared differences of one server (the points, in the order serve calls them)."""

    name: ClassVar[str]  # as the registry and the format name it (format.manifest.SERVER_NAMES)
    package: ClassVar[str]  # the module that must import for the server to run
    # its tested pin ("name==version"), installed by server-env into a venv of its own (None:
    # it runs in this environment), and the pyproject extra that installs it
    distribution: ClassVar[str | None] = None
    extra: ClassVar[str | None] = None
    serving: ClassVar[tuple[str, ...]] = ()  # what its serving path imports (pip requirements)
    proves: ClassVar[tuple[str, ...]] = ()  # modules whose import proves its venv complete
    ships: ClassVar[tuple[str, ...]] = ()  # top-level packages its distribution installs
    reads: ClassVar[tuple[str, ...]] = ()  # its server's options its room reads (options.passed)
    address: ClassVar[tuple[str, int]]  # where it binds when its options do not say
    # the command a user runs for this server without bundles, its console script first and
    # "{model}" for the model folder (what serve's side-by-side runs plainly: bench case servers)
    plain: ClassVar[tuple[str, ...]]
    unsupported: ClassVar[dict[str, str]] = {}  # server options serve refuses: {option: why}
    warm_up: ClassVar[bool] = True  # serve's --warm-up default (measured per server)
    live: ClassVar[bool] = True  # this process serves the mount (SIGHUP, the admin endpoint)
    snapshots: ClassVar[bool] = False  # `entries` lists what --snapshots saves
    # it serves Anthropic messages at /v1/messages (its `request_ids`, if any, follows them too)
    messages_route: ClassVar[bool] = False

    def refused(self, options: ServeOptions) -> dict[str, str]:
        """The options refused with these options (default: `unsupported`)."""
        return self.unsupported

    def chat_template(self, options: ServeOptions) -> str | None:
        """The chat template text the server was given, if not the model's own."""
        return options.passed("--chat-template")

    def unusable(self, bundle: Any, options: ServeOptions) -> str | None:
        """Why the server, run with these options, would never use a valid bundle (None: it will)."""
        return None

    @staticmethod
    def request_ids(tokenizer: Any, body: dict[str, Any], model_type: str) -> list[int] | None:
        """The ids the server's own request code computes for a request body, or None where
        it has no such code to call short of its app (warm-up checks it through the app). A hook
        that has such code defines this point (pipeline.runtime.servers.tokens.has_request_code)."""
        return None

    @staticmethod
    def encode_text(tokenizer: Any, text: str) -> list[int]:
        """Ids for rendered text, encoded as the server encodes a rendered prompt."""
        return list(tokenizer.encode(text))

    def install(self, mounted: Any, options: ServeOptions, snapshots: Any = None) -> None:
        """Put the cache subclass answering from `mounted` (and `snapshots`) into the server."""
        raise NotImplementedError

    def warm_up_server(self, mounted: Any, options: ServeOptions) -> None:
        """Arrange one request of the longest bundle before the port opens (servers/warm_up.py)."""

    def launch(self, mounted: Any, options: ServeOptions) -> int:
        """Run the server's own command line; returns at its stop."""
        raise NotImplementedError

    def entries(self, mounted: Any, snapshots: Any) -> list[Any]:
        """The server's own entries at a graceful stop, as (recency, Entry) for snapshots."""
        return []

    def clients_send(self, options: ServeOptions) -> str:
        """The model id clients send (the served name where the server takes one)."""
        return passed_option(list(options.rest), "--served-model-name") or str(options.model)


# what the serving paths of the FastAPI servers import, in the order server-env installs it
SERVING = (
    "fastapi", "uvicorn", "starlette>=1.0.1", "python-multipart", "psutil", "prometheus-client",
    "loguru", "openai>=2.21,<3", "openai-harmony", "dill>=0.4,<0.5", "xxhash>=3.6,<4",
)  # fmt: skip

__all__ = ["SERVING", "ServerHook"]
