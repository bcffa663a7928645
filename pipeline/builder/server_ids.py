"""Bundle ids from servers' own request code: a definition's `servers` list.

Each server builds its prompt with its own request code (request models, message and tool
conversion, template call, encode step); where that differs from the builder's rendering (omni
rebuilds tool schemas through its pydantic models, for one), a bundle built from our rendering
parts from the server's ids early. With `servers = [...]` the builder asks each listed server's
own code (pipeline.runtime.servers.tokens.request_ids, the installed server imported) for the
prefix's ids and its probe conversations', and cuts the bundle where they all agree.
"""

from __future__ import annotations

import importlib.metadata
import json
from functools import cache
from pathlib import Path
from typing import Any

from pipeline.builder.definition import LoadedDefinition
from pipeline.builder.render import Rendered, template_text
from pipeline.builder.stability import StableCut, common_prefix_length, stable_prefix
from pipeline.format.errors import BuildError, PipelineError
from pipeline.format.manifest import RequestInfo, RequestMessage
from pipeline.runtime.servers.options import install_hint
from pipeline.runtime.servers.tokens import (
    anthropic_servers,
    has_request_code,
    hook_of,
    model_type,
    request_body,
    request_ids,
)


def request_info(d: LoadedDefinition) -> RequestInfo | None:
    """The prefix as a chat request, for the manifest (None with documents: no chat API sends
    documents, so no server's request code can be asked)."""
    if d.documents:
        return None
    return RequestInfo(
        messages=[RequestMessage(role=m["role"], content=m["content"]) for m in d.messages],
        tools_json=None if d.tools is None else json.dumps(d.tools, ensure_ascii=False),
        template_kwargs=dict(d.spec.template.kwargs),
        api=d.spec.api,
        tokenization=list(d.spec.servers),
    )


def check_servers(d: LoadedDefinition) -> None:
    """BuildError before any model is loaded when the definition's servers cannot be asked."""
    where = f"{d.path}: servers"
    if d.spec.api == "anthropic":
        anthropic = anthropic_servers()
        other = [s for s in d.spec.servers if s not in anthropic]
        if not d.spec.servers or other:
            raise BuildError(
                f'{where}: api = "anthropic" needs the servers whose own Anthropic route gives '
                f"the ids: servers = {json.dumps(anthropic)} "
                f"({', '.join(other) or 'none given'} not supported for it)"
            )
    if not d.spec.servers:
        return
    if d.documents:
        raise BuildError(
            f"{where}: a server's chat request carries no documents, so its request code cannot "
            "give this prefix's ids; remove 'servers' or the documents"
        )
    if d.spec.template.date is not None:
        raise BuildError(
            f"{where}: template.date pins what strftime_now renders, but servers render today's "
            "date; remove 'servers' or use a template that does not print the date"
        )
    for server in d.spec.servers:
        if not has_request_code(server):
            raise BuildError(
                f"{where}: {server}'s request code runs only inside its app, so it cannot give "
                f"the ids (serve checks them through its app at startup); remove {server!r}"
            )
        versions(server)  # BuildError when it is not installed


@cache
def versions(server: str) -> str:
    """The installed version of a server (its pip distribution has the server's name; part of the
    build key: its code decides the ids); BuildError when it is not installed here."""
    try:
        return importlib.metadata.version(server)
    except importlib.metadata.PackageNotFoundError:
        raise BuildError(
            f"servers: {server} is not installed in this Python environment ({hook_of(server).package} "
            f"cannot be imported), so its own request code cannot give the bundle's ids; "
            f"{install_hint(server)}, or remove it from the definition's servers"
        ) from None


@cache
def server_tokenizer(model_dir: Path, template: str | None) -> Any:
    """mlx-lm's tokenizer with the pinned template, as a server started with --chat-template has."""
    from pipeline.builder.model_files import load_tokenizer

    extra = {"chat_template": template} if template is not None else None
    return load_tokenizer(Path(model_dir), tokenizer_config_extra=extra)


def server_cut(d: LoadedDefinition, model_dir: Path, rendered: Rendered) -> StableCut:
    """The stable cut of the prefix through each listed server's own request code; BuildError
    naming the token where two servers part (build one definition per server then)."""
    template = template_text(d, model_dir)[0] if d.spec.template.source == "file" else None
    tokenizer = server_tokenizer(Path(model_dir), template)
    kind = model_type(model_dir)
    cuts = {}
    for server in d.spec.servers:

        def ids_of(messages: list[dict], server: str = server) -> list[int]:
            body = request_body(messages, d.tools, d.spec.template.kwargs, d.spec.api)
            return request_ids(server, tokenizer, body, kind)

        try:
            cuts[server] = stable_prefix(ids_of(d.messages), d.messages, ids_of, tokenizer.decode)
        except PipelineError as exc:
            raise BuildError(f"{d.path}: servers: {server}: {exc}") from None
    (first, a), *others = cuts.items()
    for server, b in others:
        if a.tokens != b.tokens:
            at = common_prefix_length(a.tokens, b.tokens)
            raise BuildError(
                f"{d.path}: servers: {first} and {server} give different ids from token {at} "
                f"({first}: {tokenizer.decode(a.tokens[at : at + 8])!r}, {server}: "
                f"{tokenizer.decode(b.tokens[at : at + 8])!r}); one bundle cannot fit both: "
                "write one definition per server"
            )
    return a
