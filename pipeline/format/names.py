"""Names and numbers in bundle paths and references: prefix names, versions, NAME@VERSION.

Every parser here reads ASCII only and the whole text: `str.isdigit()` accepts '²' (which `int()`
refuses) and '٣' (which `int()` reads as 3), and a pattern ending in `$` also matches before a
final newline under Python's `re`; so nothing here uses either.
"""

from __future__ import annotations

import re

# For pydantic fields: pydantic's default (Rust) regex engine ends `$` at the end of the text and
# JSON Schema readers do too; Python code uses is_name() instead.
NAME_RULE = r"^[a-z0-9][a-z0-9._-]{0,63}$"
NAME_HINT = "1-64 of a-z 0-9 . _ - starting with a letter or digit"
MAX_VERSION = 999_999_999
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}\Z")
_VERSION = re.compile(r"^[1-9][0-9]{0,8}\Z")  # canonical: no sign, no leading zero, ASCII only
_INDEX = re.compile(r"^(0|[1-9][0-9]{0,8})\Z")
MODEL_FOLDER_RULE = r"^[a-z0-9][a-z0-9._-]*-[0-9a-f]{12}$"  # for pydantic fields, as NAME_RULE
LAYOUT_FOLDER = re.compile(r"^[a-z0-9][a-z0-9._-]*-[0-9a-f]{12}\Z")  # <slug>-<fingerprint12>


def is_name(text: object) -> bool:
    """Whether text is a valid prefix name (also a model slug and a definition file's stem)."""
    return isinstance(text, str) and _NAME.match(text) is not None


def is_model_folder(text: object) -> bool:
    """Whether text is a bundle's model folder name, <slug>-<fingerprint12>."""
    return isinstance(text, str) and LAYOUT_FOLDER.match(text) is not None


def parse_version(text: object) -> int | None:
    """A version written as its folder name (ASCII digits, no leading zero, 1..MAX_VERSION)."""
    if not isinstance(text, str) or _VERSION.match(text) is None:
        return None
    return int(text)


def parse_index(text: str) -> int | None:
    """A number from 0 written in ASCII digits without leading zeros (tensor index, release part)."""
    return int(text) if _INDEX.match(text) else None


def parse_ref(text: str) -> tuple[str, int | None] | None:
    """NAME or NAME@VERSION -> (name, version or None); None when it is neither."""
    name, at, version = text.partition("@")
    if not is_name(name):
        return None
    if not at:
        return name, None
    number = parse_version(version)
    return None if number is None else (name, number)
