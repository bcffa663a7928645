"""The prefix as text: definition messages rendered through the pinned chat template."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.definition import LoadedDefinition
from pipeline.errors import TemplateError
from pipeline.fingerprint import model_chat_template
from pipeline.template import check_pin, render, template_sha256, uses_date

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
        path = definition.path.parent / pin.file
        if not path.is_file():
            raise TemplateError(f"{definition.path}: template.file: '{pin.file}' not found")
        text, source = path.read_text(encoding="utf-8"), f"file:{pin.file}"
    else:
        text, source = model_chat_template(model_dir), "model"
        if text is None:
            raise TemplateError(
                f'model {model_dir}: ships no chat template; set template.source = "file"'
            )
    check_pin(text, pin.sha256, f"{definition.path} template ({source})")
    return text, source


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
