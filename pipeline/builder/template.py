"""Pinned chat-template rendering, byte-identical to transformers' apply_chat_template.

A jinja2-only copy of transformers/utils/chat_template_utils.py (5.x): the same sandbox, globals,
filters, `{% generation %}` tag and input normalisation. One intended difference: `strftime_now`
reads a pinned clock instead of the wall clock, so a rendered prefix is reproducible.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import re
import signal
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

from pipeline.format.errors import TemplateError
from pipeline.format.fingerprint import sha256_text

# Names a message's reasoning may come under; transformers copies it to the first and `thinking`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Template variables apply_chat_template sets itself; extra kwargs with these names break its call.
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")
# Two clocks that differ in every strftime field, so any read of the clock changes the output.
_PROBE_CLOCKS = (
    datetime.datetime(2001, 2, 3, 0, 0, 0),
    datetime.datetime(2002, 11, 24, 13, 47, 59, 123456),
)
_MIN_JINJA = (3, 1, 6)  # transformers refuses older jinja2: known sandbox escapes
_NOW: ContextVar[datetime.datetime] = ContextVar("chat_template_now")
# What a render may cost (a template is code from a model repo): a real chat template renders in
# well under a second into at most a few MB; runaway work is one line, never a hang or an OOM.
RENDER_SECONDS = 20  # wall clock, where the render runs on the main thread (SIGALRM)
RENDER_ITEMS = 1 << 26  # characters or items one `*` may make, and the rendered text's length
RENDER_POWER_BITS = 1 << 16  # bits a `**` of whole numbers may make


def template_sha256(text: str) -> str:
    """Return the sha256 hex digest of the template's UTF-8 text (the pin)."""
    return sha256_text(text)


def check_pin(text: str, expected_sha256: str, source: str) -> None:
    """Raise TemplateError unless the template text hashes to its pinned sha256."""
    actual = template_sha256(text)
    if actual != expected_sha256.strip().lower():
        raise TemplateError(
            f"chat template {source}: sha256 mismatch (expected {expected_sha256}, got {actual}); "
            f'review the template change, then pin sha256 = "{actual}" or restore the old template'
        )


def render(
    template: str,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    add_generation_prompt: bool = False,
    special_tokens: dict[str, str] | None = None,
    date: datetime.date | None = None,
    extra: dict | None = None,
) -> str:
    """Render messages exactly as transformers' apply_chat_template(tokenize=False) does."""
    day = date if date is not None else datetime.date.today()
    now = datetime.datetime.combine(day, datetime.time())
    inputs = _variables(messages, tools, documents, add_generation_prompt, special_tokens, extra)
    return _render(template, inputs, now)


def uses_date(
    template: str,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    add_generation_prompt: bool = False,
    special_tokens: dict[str, str] | None = None,
    date: datetime.date | None = None,
    extra: dict | None = None,
) -> bool:
    """Return True when the output changes with the clock (`date` is accepted and ignored)."""
    inputs = _variables(messages, tools, documents, add_generation_prompt, special_tokens, extra)
    first, second = (_render(template, inputs, now) for now in _PROBE_CLOCKS)
    return first != second


def _render(template: str, inputs: dict[str, Any], now: datetime.datetime) -> str:
    """Render with the clock pinned to `now`; whatever the template raises becomes TemplateError."""
    compiled = _compile(template)
    token = _NOW.set(now)
    try:
        with _time_limit(RENDER_SECONDS):
            text = compiled.render(**inputs)
    except _TooCostly as exc:
        raise TemplateError(f"chat template {exc}; fix the template") from None
    except Exception as exc:  # a template is code: anything it raises is its failure, not ours
        raise _render_error(exc) from exc
    finally:
        _NOW.reset(token)
    if len(text) > RENDER_ITEMS:
        raise TemplateError(
            f"chat template rendered {len(text):,} characters, over the {RENDER_ITEMS:,} a prefix "
            "may have; fix the template"
        )
    return text


class _TooCostly(Exception):  # noqa: N818 - said as "chat template <message>"
    """A render past RENDER_SECONDS, or one operation past its size limit."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Interrupt a render still running after `seconds` (SIGALRM: on the main thread only; a
    render elsewhere has the size limits alone). A timer already set is left as it was."""
    usable = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    if not usable or signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        yield
        return

    def expired(signum: int, frame: Any) -> None:
        raise _TooCostly(f"took over {seconds:g} s to render (a runaway loop?)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _variables(
    messages: list[dict],
    tools: list[dict] | None,
    documents: list[dict] | None,
    add_generation_prompt: bool,
    special_tokens: dict[str, str] | None,
    extra: dict | None,
) -> dict[str, Any]:
    """Build the template variables the way apply_chat_template and render_jinja_template do."""
    for name, value in (special_tokens or {}).items():
        if not isinstance(value, str):
            raise TemplateError(f"special token {name}={value!r} is not a string; pass its text")
    for name in extra or {}:
        if not isinstance(name, str) or name in RESERVED_TEMPLATE_VARIABLES:
            reserved = ", ".join(RESERVED_TEMPLATE_VARIABLES)
            raise TemplateError(f"extra variable {name!r} is not allowed; pass {reserved} as args")
    inputs = _plain({**(special_tokens or {}), **(extra or {})})  # extra overrides special tokens
    inputs.update(
        messages=_messages(messages),
        tools=_tools(tools),
        documents=_documents(documents),
        add_generation_prompt=add_generation_prompt,
    )
    return inputs


def _messages(messages: list[dict]) -> list[dict]:
    """Normalise one conversation: plain data, keys valued None dropped, reasoning aliased."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TemplateError(f"messages is {messages!r:.80}; pass a non-empty list of message dicts")
    chat = []
    for index, message in enumerate(_plain(list(messages))):
        if not isinstance(message, dict):
            raise TemplateError(f"messages[{index}] is {message!r:.80}; pass message dicts")
        chat.append({key: value for key, value in message.items() if value is not None})
    return [_alias_reasoning(message) for message in chat]


def _alias_reasoning(message: dict) -> dict:
    """Copy a message's reasoning to `reasoning_content` and `thinking`, as transformers does."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tools(tools: list[dict] | None) -> list[dict] | None:
    """Check tools are JSON-schema dicts (transformers would convert callables; we do not)."""
    if tools is None:
        return None
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise TemplateError(
                f"tools[{index}] is {type(tool).__name__}, not a JSON-schema dict; "
                'pass {"type": "function", "function": {...}} dicts'
            )
    return _plain(list(tools))


def _documents(documents: list[dict] | None) -> list[dict] | None:
    """Check documents are dicts, as transformers does."""
    if documents is None:
        return None
    for index, document in enumerate(documents):
        if not isinstance(document, dict):
            kind = type(document).__name__
            raise TemplateError(f"documents[{index}] is a {kind}; pass dicts with 'title', 'text'")
    return _plain(documents)


def _plain(value: Any) -> Any:
    """Rebuild a value from plain JSON types, as transformers' _plain_template_data does."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, ...) carry methods: strip to the base type
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if any(cls.__module__ == "numpy" and cls.__name__ == "generic" for cls in type(value).__mro__):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


@lru_cache(maxsize=64)
def _compile(template: str) -> jinja2.Template:
    """Compile a template in transformers' environment; syntax and unknown names fail here."""
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:  # also unknown filters, tests and tags
        raise TemplateError(
            f"chat template does not compile at line {exc.lineno}: {_one_line(exc.message or '')}; "
            "fix the template, or use only the jinja2 features transformers supports"
        ) from None


@lru_cache(maxsize=1)
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """Build the environment of transformers' _cached_compile_jinja_template."""
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", jinja2.__version__)
    if found is None or tuple(int(part) for part in found.groups()) < _MIN_JINJA:
        raise TemplateError(
            f"jinja2 {jinja2.__version__} is older than 3.1.6 and has known sandbox escapes; "
            "upgrade it with `pip install -U jinja2`"
        )
    env = _BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


class _BoundedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """transformers' sandbox, with `*` and `**` held to what a prompt could need ('a' * 10**9
    would take gigabytes before anything could check the output)."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                sized = isinstance(seq, (str, bytes, list, tuple))
                if sized and isinstance(n, int) and len(seq) * n > RENDER_ITEMS:
                    raise _TooCostly(
                        f"asks for {len(seq) * n:,} items in one `*`, over {RENDER_ITEMS:,}"
                    )
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            if max(abs(left), 1).bit_length() * right > RENDER_POWER_BITS:
                raise _TooCostly(f"asks for a number of over {RENDER_POWER_BITS:,} bits in `**`")
        return super().call_binop(context, operator, left, right)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body (transformers tracks its span)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateRaised(jinja2.TemplateError):
    """The template called raise_exception(message)."""


def _raise_exception(message: str) -> None:
    """Let a template refuse its input, as transformers' raise_exception global does."""
    raise _TemplateRaised(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson: plain json.dumps (no HTML escaping) with its options exposed."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    """Format the pinned clock of the render in progress."""
    return _NOW.get().strftime(format)


class _TemplateDict:
    """The `dict` global: builds dicts without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """The `namespace` global: refuses underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's trick: namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}. Please rename the attribute."
            )


def _render_error(exc: Exception) -> TemplateError:
    """Turn what a render raised into a one-line TemplateError naming the template line."""
    frames = traceback.walk_tb(exc.__traceback__)
    lines = [line for frame, line in frames if frame.f_code.co_filename == "<template>"]
    where = f" at line {lines[-1]}" if lines else ""
    if isinstance(exc, _TemplateRaised):
        return TemplateError(
            f"chat template refused the input{where}: {_one_line(str(exc))}; "
            "change the messages to fit the template"
        )
    return TemplateError(
        f"chat template failed{where}: {type(exc).__name__}: {_one_line(str(exc))}; "
        "fix the template or the inputs it reads"
    )


def _one_line(text: str) -> str:
    """Collapse whitespace so a message fits on one line."""
    return " ".join(text.split())
