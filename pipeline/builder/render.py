"""The prefix as text: definition messages rendered through the pinned chat template."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.builder.definition import LoadedDefinition
from pipeline.builder.template import check_pin, render, template_sha256, uses_date
from pipeline.format.errors import TemplateError
from pipeline.format.fingerprint import model_chat_template

SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


@dataclass(frozen=True)
class Rendered:
    """The prefix rendered through the pinned template."""

    text: str
    template_sha256: str
    template_source: str


def special_tokens(model_dir: Path) -> dict[str, str]:
    """bos/eos/pad/unk token strings from tokenizer_config.json, as templates see them."""
    path = Path(model_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    out = {}
    for key in SPECIAL_TOKENS:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def template_text(definition: LoadedDefinition, model_dir: Path) -> tuple[str, str]:
    """(template text, source label) for the definition's pin, checked against its sha256."""
    pin = definition.spec.template
    if pin.source == "file":
        text, source = definition.template_file_text or "", f"file:{pin.file}"
    else:
        text, source = model_chat_template(model_dir), "model"
        if text is None:
            raise TemplateError(
                f'model {model_dir}: ships no chat template; set template.source = "file"'
            )
    check_pin(text, pin.sha256, f"{definition.path} template ({source})")
    return text, source


def check_rendered(definition: LoadedDefinition, text: str) -> None:
    """Refuse a render that lost part of the prefix (a folded or dropped turn, ignored tools)."""
    for i, message in enumerate(definition.messages):
        role = message["role"]
        if definition.spec.prefix.messages[i].dropped_by_template:
            if message["content"].strip() in text:
                raise TemplateError(
                    f"{definition.path}: prefix.messages.{i}: marked dropped_by_template, but the "
                    f"template renders the {role} content; remove dropped_by_template"
                )
            continue
        if message["content"].strip() not in text:
            raise TemplateError(
                f"{definition.path}: prefix.messages.{i}: the {role} content does not appear in "
                f"the rendered prefix (the template folds or drops a {role} turn when nothing "
                f"follows it); add a user turn to the prefix or use a template that renders {role} turns"
            )
    for tool in definition.tools or []:
        if tool["function"]["name"] not in text:
            raise TemplateError(
                f"{definition.path}: prefix.tools_file: tool {tool['function']['name']!r} does not "
                "appear in the rendered prefix; the pinned template ignores tools: use one that renders them"
            )
    for i, doc in enumerate(definition.documents or []):
        if doc["text"].strip() not in text:
            raise TemplateError(
                f"{definition.path}: prefix.documents.{i}: the document does not appear in the "
                "rendered prefix; the pinned template ignores documents: use one that renders them"
            )


def render_prefix(definition: LoadedDefinition, model_dir: Path, **overrides: Any) -> Rendered:
    """Render the prefix messages through the pinned template (no generation prompt)."""
    text, source = template_text(definition, model_dir)
    pin = definition.spec.template
    kwargs = dict(
        tools=definition.tools,
        documents=definition.documents,
        special_tokens=special_tokens(model_dir),
        extra=pin.kwargs,
    )
    messages = overrides.pop("messages", definition.messages)
    if pin.date is None and uses_date(text, messages, **kwargs):
        raise TemplateError(
            f"{definition.path}: the template's output depends on today's date (strftime_now); "
            "pin it with template.date = YYYY-MM-DD so the bundle stays a prefix of served prompts"
        )
    rendered = render(text, messages, date=pin.date, **kwargs, **overrides)
    return Rendered(rendered, template_sha256(text), source)
