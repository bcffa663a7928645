"""Re-executing this process with a changed environment (settings a process reads only at start)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence


def reexec_argv(argv: Sequence[str], orig_argv: Sequence[str], executable: str) -> list[str] | None:
    """This process's command line run by `executable`, or None when `argv` is not its tail."""
    # orig_argv keeps interpreter options and `build.py serve` or the console script; when it does
    # not end with the entry's own arguments, the entry was called in-process (a test, an
    # embedder): never replace that process.
    tail = list(orig_argv[len(orig_argv) - len(argv) :])
    if not executable or len(orig_argv) <= len(argv) or tail != list(argv):
        return None
    return [executable, *orig_argv[1:]]


def execute(argv: list[str], env: dict[str, str]) -> None:
    """Replace this process (same pid) with argv under env; never returns."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)
