"""The request serve's "try" line logs when a bundle is mounted: the longest mounted bundle's
recorded request (its prefix, as the startup tokenization check ran it, then the builder's probe
turn) as a client sends it to this server, and how many of its tokens the one reuse rule
(`Mounted.covered`) takes from the bundle, counted on the ids this server computes for it.

The body holds the whole prefix (tens of kilobytes): the logged command prints it from the bundle
folder and pipes it to curl, so serve writes no file for it:

  PYTHONPATH=ROOT python -m pipeline.runtime.servers.try_request BUNDLE MODEL [openai|anthropic] \\
    | curl -s URL -H 'Content-Type: application/json' -d @-
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.format.errors import PipelineError
from pipeline.format.manifest import RequestInfo
from pipeline.runtime.servers.hook import ServerHook
from pipeline.runtime.servers.mounted import Mounted
from pipeline.runtime.servers.tokens import (
    PROBE_TURN,
    has_request_code,
    model_type,
    request_body,
    request_ids,
)

MAX_TOKENS = 16


@dataclass(frozen=True)
class TryRequest:
    route: str  # /v1/chat/completions or /v1/messages
    printer: str  # the command line that prints the body
    bundle: str  # name@version
    taken: int  # tokens the reuse rule takes from the bundle for this request
    total: int  # the bundle's tokens


def body_of(request: RequestInfo, model: str, api: str) -> dict[str, Any]:
    """The recorded request and the probe turn, as a client sends it in `api`'s form."""
    messages = [m.model_dump() for m in request.messages] + [PROBE_TURN]
    tools = None if request.tools_json is None else json.loads(request.tools_json)
    body = request_body(messages, tools, request.template_kwargs, api)
    return {"model": model, **body, "max_tokens": MAX_TOKENS}


def try_request(
    hook: ServerHook, mounted: Mounted, model: str, tokenizer: Callable[[], Any]
) -> TryRequest | None:
    """The try request on the longest bundle that records its request; None when none does (or
    this server refuses it: the plain try line then stands). `tokenizer`: the server's tokenizer
    (startup.server_tokenizer), loaded only when a bundle records its request."""
    recorded = [b for b in mounted.result.bundles if b.manifest.request is not None]
    if not recorded:
        return None
    bundle = max(recorded, key=lambda b: len(b.tokens))
    request = bundle.manifest.request
    api = "anthropic" if request.api == "anthropic" and hook.messages_route else "openai"
    body = body_of(request, model, api)
    try:
        ids = server_ids(hook, mounted, tokenizer(), body, request)
    except PipelineError:
        return None
    taken = mounted.covered(ids)
    if bundle.name in mounted.reusable:  # what the startup check found this server keeps
        taken = min(taken, mounted.reusable[bundle.name])
    route = "/v1/messages" if api == "anthropic" else "/v1/chat/completions"
    return TryRequest(
        route, printer(bundle.path, model, api), bundle.name, taken, len(bundle.tokens)
    )


def printer(bundle: Path, model: str, api: str) -> str:
    """The command that prints the body: this module, run by this Python with this package on its
    path (serve may run from a checkout, where `pipeline` imports only beside build.py)."""
    import pipeline

    root = Path(pipeline.__file__).resolve().parents[1]
    found = [sys.executable, "-m", __name__, str(bundle.resolve()), model, api]
    return f"PYTHONPATH={shlex.quote(str(root))} {shlex.join(found)}"


def server_ids(
    hook: ServerHook, mounted: Mounted, tokenizer: Any, body: dict[str, Any], request: RequestInfo
) -> list[int]:
    """The ids this server computes for the body: its own request code where it has code to call,
    else the request as the builder renders it with the template (the startup check's figure caps
    what it keeps)."""
    if has_request_code(hook.name):
        return request_ids(hook.name, tokenizer, body, model_type(mounted.model))
    openai = body_of(request, "model", "openai")
    rendered = tokenizer.apply_chat_template(
        openai["messages"],
        tools=openai.get("tools"),
        add_generation_prompt=True,
        **request.template_kwargs,
    )
    return [int(t) for t in rendered]


def main(argv: list[str]) -> int:
    """Print the try request's body for a bundle folder (the logged command's first half)."""
    from pipeline.format.bundle_folder import read_manifest

    if len(argv) not in (2, 3) or (argv[2:] and argv[2] not in ("openai", "anthropic")):
        print(f"usage: python -m {__name__} BUNDLE MODEL [openai|anthropic]", file=sys.stderr)
        return 2
    try:
        request = read_manifest(Path(argv[0]), None).request
        if request is None:
            raise PipelineError(f"{argv[0]}: the bundle records no request; rebuild it")
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(body_of(request, argv[1], (argv[2:] or ["openai"])[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
