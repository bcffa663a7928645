"""A chat request as a server receives it (for `match`), checked with the definitions' schema.

Messages share the definition's roles and strictness (extra="forbid"); tools are the same
ToolSpec a definition's tools_file must follow. Content is a string or, as mlx_lm.server accepts,
a list of text parts, which the server joins into one string before the template sees it.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.builder.definition import Role, Strict, ToolSpec, _first_error
from pipeline.format.errors import PipelineError

CONTENT_RULE = 'a string or a list of text parts [{"type": "text", "text": "..."}]'


class TextPart(Strict):
    """One part of OpenAI list content; only text parts reach a text model's template."""

    type: Literal["text"]
    text: str


class RequestMessage(Strict):
    """One message of a chat request (OpenAI chat format)."""

    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        parts_ok = isinstance(value, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in value
        )
        if value is None or isinstance(value, str) or parts_ok:
            return value
        raise ValueError(
            f"give {CONTENT_RULE} (got {_short(value)}; other part types are not supported)"
        )

    @model_validator(mode="after")
    def _has_content(self) -> RequestMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"'content' is missing; give {CONTENT_RULE}")
        return self


class ChatRequest(Strict):
    """A request body: its messages and tools; other request fields do not change the prompt."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    messages: list[RequestMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_request(body: Any, where: str) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """(messages, tools) as mlx_lm.server hands them to the chat template; a bare list is the
    messages. PipelineError naming the field when the request does not fit the schema."""
    body = {"messages": body} if isinstance(body, list) else body
    if not isinstance(body, dict):
        raise PipelineError(
            f'{where}: the request is {_short(body)}; give {{"messages": [...]}} or a list of messages'
        )
    try:
        ChatRequest.model_validate(body)
    except ValidationError as exc:
        raise PipelineError(f"{where}: {_first_error(exc)}") from None
    from mlx_lm.server import process_message_content

    # the request's own dicts (key order reaches the template), changed only as the server does
    messages = copy.deepcopy(body["messages"])
    try:
        process_message_content(messages)
    except (ValueError, TypeError, KeyError) as exc:  # tool call arguments that are not JSON
        raise PipelineError(f"{where}: mlx_lm.server would refuse these messages ({exc})") from None
    return messages, body.get("tools")
