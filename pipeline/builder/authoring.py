"""Authoring help: a first definition for a model (`new`), and why a request does or does not reuse a bundle (`match`)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.builder.definition import _parse_tools, load_definition
from pipeline.builder.stability import common_prefix_length
from pipeline.format.errors import DefinitionError, TemplateError
from pipeline.format.fingerprint import model_chat_template, sha256_text
from pipeline.format.names import NAME_HINT, is_name
from pipeline.format.regular_files import FileProblem, read_text
from pipeline.format.validate import Validated

STARTER_SYSTEM = "You are a helpful assistant. Replace this text with the prefix's system prompt.\n"


def _model_ref(model_dir: Path, repo_root: Path) -> str:
    """The model path as a definition writes it: relative to the repo root when inside it."""
    path = Path(model_dir).resolve()
    return str(path.relative_to(repo_root)) if path.is_relative_to(repo_root) else str(path)


def _read_input(path: Path, what: str) -> str:
    try:
        return read_text(Path(path), 64 << 20)
    except FileProblem as exc:
        raise DefinitionError(f"{what} {path}: {exc}; pass a readable UTF-8 file") from None


def new_definition(
    prefix_dir: Path, name: str, model_dir: Path, system_file: Path | None, tools_file: Path | None
) -> Path:
    """Write prefixes/<name>.toml (+ prefixes/<name>/) pinned to the model's template; return it.

    Nothing is left behind when any step fails: the files are written, then loaded back through
    the definition schema, and removed again if that fails.
    """
    prefix_dir = Path(prefix_dir)
    if not is_name(name):
        raise DefinitionError(f"name {name!r}: use {NAME_HINT}")
    path, folder = prefix_dir / f"{name}.toml", prefix_dir / name
    if path.exists() or folder.exists():
        raise DefinitionError(
            f"{path}: already exists; choose another name or edit it and bump version"
        )
    template = model_chat_template(model_dir)
    if template is None:
        raise TemplateError(
            f'model {model_dir}: ships no chat template; write a definition with template.source = "file"'
        )
    system = _read_input(system_file, "--system-file") if system_file else STARTER_SYSTEM
    tools = _read_input(tools_file, "--tools") if tools_file else None
    if tools is not None:
        _parse_tools(tools, Path(tools_file))
    repo_root = prefix_dir.resolve().parent
    folder.mkdir(parents=True)
    try:
        (folder / "system.md").write_text(system)
        lines = [f'name = "{name}"', "version = 1", "", "[template]", 'source = "model"']
        lines += [f'sha256 = "{sha256_text(template)}"', "", "[prefix]"]
        if tools is not None:
            (folder / "tools.json").write_text(tools)
            lines.append(f'tools_file = "{name}/tools.json"')
        lines += [
            "",
            "[[prefix.messages]]",
            'role = "system"',
            f'content_files = ["{name}/system.md"]',
        ]
        lines += ["", "[[models]]", f"path = {json.dumps(_model_ref(model_dir, repo_root))}", ""]
        path.write_text("\n".join(lines))
        load_definition(path, repo_root)
    except BaseException:
        path.unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return path


@dataclass(frozen=True)
class Match:
    """How much of a request a bundle covers, and where they part when it is not all."""

    bundle: Path
    name: str
    bundle_tokens: int
    common_tokens: int  # leading tokens the request shares with the bundle
    reused_tokens: int  # what a server reuses: the common part, leaving >= 1 token to process
    divergence: str | None  # where and how the request and the bundle differ


TRIMMABLE = {"KVCache", "QuantizedKVCache"}  # others are reused only when extended whole


def match_request(
    model_dir: Path,
    bundles: list[Validated],
    messages: list[dict],
    tools: list[dict] | None,
    server: str = "mlx-lm",
) -> tuple[list[int], list[Match]]:
    """The request's tokens as `server`'s own request code computes them
    (pipeline.runtime.servers.tokens), and each bundle's match, best first."""
    from mlx_lm.utils import load_tokenizer

    from pipeline.runtime.servers.tokens import chat_body, model_type, request_ids

    tokenizer = load_tokenizer(Path(model_dir))
    body = chat_body(messages, tools, {})
    ids = request_ids(server, tokenizer, body, model_type(model_dir))
    request = list(ids)
    out = []
    for b in bundles:
        common = common_prefix_length(b.tokens, request)
        whole = common == len(b.tokens)
        trimmable = set(b.manifest.cache.classes) <= TRIMMABLE
        reused = min(common, len(request) - 1) if whole or trimmable else 0
        part = None if whole else _divergence(tokenizer, b.tokens, request, common)
        name = f"{b.manifest.prefix.name}@{b.manifest.prefix.version}"
        out.append(Match(b.path, name, len(b.tokens), common, reused, part))
    return request, sorted(out, key=lambda m: -m.reused_tokens)


def _divergence(tokenizer: Any, bundle: list[int], request: list[int], at: int) -> str:
    """Where the texts part: the character offset in the request and a few characters of each."""
    offset = len(tokenizer.decode(request[:at]))
    ours = tokenizer.decode(bundle[at : at + 8])
    theirs = tokenizer.decode(request[at : at + 8])
    return f"at token {at} (character {offset} of the request): bundle has {ours!r}, request has {theirs!r}"
