"""`serve --huge-pages`: glibc's malloc on transparent huge pages (THP), Linux with glibc only.

glibc reads GLIBC_TUNABLES once, at process start, so `on` re-executes the process with
`glibc.malloc.hugetlb=1` added; setting it from inside Python would change nothing.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from pipeline.format.names import parse_index
from pipeline.reexec import execute, reexec_argv

log = logging.getLogger("prefix-bundles")

CHOICES = ("on", "off")
# The default until benchmarks say otherwise; serve's --huge-pages reads it from here.
DEFAULT_HUGE_PAGES = "off"
TUNABLE_NAME = "glibc.malloc.hugetlb"
TUNABLE = f"{TUNABLE_NAME}=1"
GLIBC_MIN = (2, 35)  # the first glibc with glibc.malloc.hugetlb; older ones ignore it silently
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# Set to the pid that re-executed itself: the same pid seeing it again means the tunable was lost.
REEXEC_MARKER = "PREFIX_BUNDLES_HUGE_PAGES_REEXEC"


def hugetlb_value(env: Mapping[str, str]) -> str | None:
    """The glibc.malloc.hugetlb value GLIBC_TUNABLES sets in env (the last one wins), or None."""
    values = [
        t.split("=", 1)[1]
        for t in env.get("GLIBC_TUNABLES", "").split(":")
        if t.startswith(TUNABLE_NAME + "=")
    ]
    return values[-1] if values else None


def with_tunable(env: Mapping[str, str], pid: int) -> dict[str, str]:
    """A copy of env whose GLIBC_TUNABLES keeps its other tunables and ends with the hugetlb one."""
    kept = [
        t
        for t in env.get("GLIBC_TUNABLES", "").split(":")
        if t and not t.startswith(TUNABLE_NAME + "=")
    ]
    return {**env, "GLIBC_TUNABLES": ":".join([*kept, TUNABLE]), REEXEC_MARKER: str(pid)}


def unsupported(system: str, libc: tuple[str, str]) -> str | None:
    """Why the tunable cannot work on this platform, or None when it can."""
    if system != "Linux":
        return f"on {system} (Linux with glibc only)"
    name, version = libc
    if name != "glibc":
        return f"without glibc ({name or 'libc unknown'})"
    parts = tuple(n for p in version.split(".")[:2] if (n := parse_index(p)) is not None)
    if parts < GLIBC_MIN:
        return f"with glibc {version} ({TUNABLE_NAME} needs glibc {'.'.join(map(str, GLIBC_MIN))}+)"
    return None


def thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The kernel's THP mode ('always', 'madvise' or 'never'), or None where it cannot be read."""
    try:
        text = path.read_text()
    except OSError:
        return None
    return next((w[1:-1] for w in text.split() if w.startswith("[")), None)


def status_line(setting: str, value: str | None, thp: str | None) -> str:
    """The one INFO line: whether huge pages are on, and whether THP can serve them."""
    if value in (None, "0"):
        state = "off"
    elif setting == "on":
        state = f"on (GLIBC_TUNABLES {TUNABLE_NAME}={value})"
    else:
        state = f"on: GLIBC_TUNABLES sets {TUNABLE_NAME}={value} (--huge-pages off leaves it)"
    if thp is None:
        kernel = f"not available ({THP_ENABLED} unreadable)"
    elif thp == "never":
        kernel = "'never', so huge pages cannot help (needs madvise or always)"
    else:
        kernel = repr(thp)
    return f"huge pages: {state}; transparent huge pages: {kernel}"


def ensure_huge_pages(setting: str, serve_argv: Sequence[str]) -> None:
    """Log whether huge pages are on; with `on`, re-execute with the tunable if it is missing."""
    looped = os.environ.pop(REEXEC_MARKER, None) == str(os.getpid())
    value = hugetlb_value(os.environ)
    if setting == "on" and value in (None, "0"):
        reason = unsupported(platform.system(), platform.libc_ver())
        if reason is not None:
            log.info("huge pages: --huge-pages on has no effect %s", reason)
            return
        argv = None if looped else reexec_argv(serve_argv, sys.orig_argv, sys.executable)
        if argv is not None:
            log.debug("huge pages: re-executing %s with %s", argv, TUNABLE)
            execute(argv, with_tunable(os.environ, os.getpid()))
        log.warning(
            "huge pages: --huge-pages on has no effect: %s; start serve with "
            "GLIBC_TUNABLES=%s in its environment instead",
            "GLIBC_TUNABLES was lost re-executing serve"
            if looped
            else "cannot re-execute serve (its arguments are not this process's command line)",
            TUNABLE,
        )
    log.info("%s", status_line(setting, value, thp_mode()))
