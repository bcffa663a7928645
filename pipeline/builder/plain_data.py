"""TOML and JSON a person wrote: parsed with nesting bounded, checked to hold only what JSON holds.

A definition's free-form values (template kwargs, tool schemas) are hashed as canonical JSON and
sent to servers in request bodies, so a TOML date or a NaN in them must be refused with a line
naming it, not fail deep in a hash; a value nested thousands deep must be one error, not a
RecursionError.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

MAX_DEPTH = 64  # levels of lists and tables in a free-form value; real ones use a handful
TOO_DEEP = "nested too deeply for this parser; flatten it"


def parse_toml(text: str) -> dict[str, Any]:
    """tomllib.loads; ValueError (TOMLDecodeError or too deep) when the text is not usable TOML."""
    if text.startswith("\ufeff"):  # tomllib's own error would be "Invalid statement" at 1:1
        raise ValueError("it starts with a UTF-8 byte-order mark; save it without one")
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise ValueError(TOO_DEEP) from None


def parse_json(text: str | bytes) -> Any:
    """json.loads, refusing NaN and Infinity (not JSON) and nesting past the parser's limit with
    ValueError."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise ValueError(TOO_DEEP) from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def json_problem(value: Any) -> str | None:
    """Why `value` is not plain JSON data (strings, finite numbers, booleans, null, lists, tables
    with string keys, at most MAX_DEPTH levels), naming where in it; None when it is."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, where, depth = stack.pop()
        at = f"'{where}'" if where else "the value"
        if depth > MAX_DEPTH:
            return (
                f"'{where.split('.')[0]}' is nested more than {MAX_DEPTH} levels deep; flatten it"
            )
        if isinstance(item, dict):
            bad = next((k for k in item if not isinstance(k, str)), None)
            if bad is not None:
                return f"{at} has the key {bad!r}; JSON keys are strings"
            children = list(item.items())
        elif isinstance(item, list):
            children = list(enumerate(item))
        else:
            problem = _scalar_problem(item)
            if problem:
                return f"{at} = {item} {problem}"
            continue
        for key, child in reversed(children):  # reported in document order
            stack.append((child, f"{where}.{key}" if where else str(key), depth + 1))
    return None


def _scalar_problem(item: Any) -> str | None:
    if isinstance(item, float) and not math.isfinite(item):
        return "is not a number JSON can hold; use a finite number or a string"
    if item is None or isinstance(item, (str, int, float, bool)):
        return None
    kind = type(item).__name__  # date, datetime, time: what TOML has and JSON has not
    return f'is a TOML {kind}, which JSON cannot hold; quote it as a string: "{item}"'


def toml_string(text: str) -> str:
    """`text` as a TOML basic string: quotes, backslashes and control characters escaped, every
    other character (a non-BMP one too) as it is; ValueError for a lone surrogate (a file name
    whose bytes are not UTF-8), which no TOML string holds."""
    out = []
    for ch in text:
        if "\ud800" <= ch <= "\udfff":
            raise ValueError(f"{text!r} holds bytes that are not UTF-8 text")
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch < " " or ch == "\x7f":
            out.append(_SHORT.get(ch) or f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


_SHORT = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
