"""The one argparse class every parser of the CLI is made from: no abbreviations, each option once.

An abbreviation that silently matches another option, an empty path (the current folder), or a
second value that silently replaces the first (`--sign-key a.key --sign-key b.key` signing with b only), is how wrong things happen:
both are usage errors here, for every command, the ones added later included. Options meant to
repeat (action append, count, extend) are left alone; a list of names that must differ takes
action="distinct". What a parse was given is kept (`given_options`), for a command to refuse an
option that does not apply to the form used.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

# the namespace attribute where a parse records each dest given, with the option string used
GIVEN = "_given_options"


def given_options(args: argparse.Namespace) -> dict[str, str]:
    """Each option the command line gave, by dest: the option string used ('--model')."""
    return getattr(args, GIVEN, {})


def twice(first: str, second: str) -> str:
    """The usage error for a dest set a second time."""
    if first == second:
        return f"{first} given twice; pass it once"
    return f"{first} and {second} given together; pass one of them"


class Once(argparse.Action):
    """Mixed into every action that sets one value: a second setting of its dest is refused."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if option_string is not None:  # a positional is set once by argparse itself
            given = vars(namespace).setdefault(GIVEN, {})
            if self.dest in given:
                raise argparse.ArgumentError(None, twice(given[self.dest], option_string))
            given[self.dest] = option_string
        super().__call__(parser, namespace, values, option_string)


class _Distinct(Once, argparse._StoreAction):
    """action="distinct": a list of names each given once (`build shop shop` is refused); paths
    are compared as the folders they name (`sign a ./a/` signs one bundle: refused too)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        seen: dict[str, str] = {}
        for value in values:
            key = os.path.realpath(value) if isinstance(value, Path) else str(value)
            if key in seen:
                same = (
                    f"{value} given twice"
                    if seen[key] == str(value)
                    else (f"{seen[key]} and {value} name the same folder")
                )
                raise argparse.ArgumentError(None, f"{same}; name it once")
            seen[key] = str(value)
        super().__call__(parser, namespace, values, option_string)


SINGLE_VALUED: dict[Any, type[argparse.Action]] = {
    name: type(f"Once{cls.__name__.lstrip('_')}", (Once, cls), {})
    for name, cls in (
        (None, argparse._StoreAction),
        ("store", argparse._StoreAction),
        ("store_const", argparse._StoreConstAction),
        ("store_true", argparse._StoreTrueAction),
        ("store_false", argparse._StoreFalseAction),
        (argparse.BooleanOptionalAction, argparse.BooleanOptionalAction),  # --x then --no-x
    )
}


class _Subcommands(argparse._SubParsersAction):
    """The command's own options are parsed in a fresh namespace: an option given both before
    the command and after it (`--prefixes a build --prefixes b`) is refused here."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        before = vars(namespace).pop(GIVEN, {})
        super().__call__(parser, namespace, values, option_string)
        after = given_options(namespace)
        for dest in sorted(before.keys() & after.keys()):
            self.choices[values[0]].error(twice(before[dest], after[dest]))
        setattr(namespace, GIVEN, {**before, **after})


def nonempty(text: str) -> str:
    """A value that names something (a model folder or hub repo kept as text): not empty."""
    if not text:
        raise argparse.ArgumentTypeError(
            "an empty path (it would mean the current folder); give one"
        )
    return text


def _path(text: str) -> Path:
    """type=Path, refusing an empty value: Path("") is the current folder (an unset variable in
    `--snapshots "$DIR"` wrote snapshots there)."""
    return Path(nonempty(text))


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser whose subcommand parsers are CliParsers too (argparse makes them of the
    parent's class): abbreviations off, single-valued options at most once, no empty path."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})
        for name, action in SINGLE_VALUED.items():
            self.register("action", name, action)
        self.register("action", "distinct", _Distinct)
        self.register("type", Path, _path)  # every type=Path, in groups too
        self.register("action", "parsers", _Subcommands)
