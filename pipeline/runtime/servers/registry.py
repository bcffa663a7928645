"""The one list of servers `serve --server NAME` wraps: one line per server naming its room (a
package under pipeline/runtime/servers/ whose `Hook` declares everything else: its package and
tested pin, the extra it installs, what its serving path imports, the options it reads). Below the
start-up sequence: it names rooms as strings and imports one only when asked, so nothing here
imports a server or the sequence. server-env, the option table, `serve --server` and the tests
read this list; the format's SERVER_NAMES (what a manifest may record) must equal it (a test)."""

from __future__ import annotations

import importlib
from typing import Any

from pipeline.format.errors import PipelineError

ROOMS = {
    "mlx-lm": "pipeline.runtime.servers.mlx_lm",
    "vllm-mlx": "pipeline.runtime.servers.vllm_mlx",
    "rapid-mlx": "pipeline.runtime.servers.rapid_mlx",
    "mlx-omni-server": "pipeline.runtime.servers.mlx_omni",
    "mlx-openai-server": "pipeline.runtime.servers.mlx_openai",
}


def names() -> tuple[str, ...]:
    """Every server serve wraps, in the registry's order (the first is the default)."""
    return tuple(ROOMS)


def hook_class(server: str) -> type:
    """The `Hook` class a server's room declares; PipelineError for a name not listed."""
    if server not in ROOMS:
        raise PipelineError(f"unknown server {server!r}; choose one of {', '.join(ROOMS)}")
    return importlib.import_module(ROOMS[server]).Hook


def hook_for(server: str) -> Any:
    """The hook (a ServerHook) of a listed server."""
    return hook_class(server)()


def venv_groups() -> list[list[str]]:
    """The servers installed in a virtual environment of their own (a `distribution` pin), in
    groups that can share one (none ships a top-level package another ships), each group in the
    registry's order."""
    groups: list[list[str]] = []
    for name in ROOMS:
        if hook_class(name).distribution is None:
            continue
        fits = next((g for g in groups if not any(clash(name, other) for other in g)), None)
        if fits is None:
            groups.append([name])
        else:
            fits.append(name)
    return groups


def installed_apart() -> list[str]:
    """`venv_groups`, one group after the other (what server-env makes)."""
    return [name for group in venv_groups() for name in group]


def clash(a: str, b: str) -> set[str]:
    """The top-level packages both servers' distributions install (they then cannot share one
    virtual environment)."""
    return set(hook_class(a).ships) & set(hook_class(b).ships)


__all__ = [
    "ROOMS",
    "clash",
    "hook_class",
    "hook_for",
    "installed_apart",
    "names",
    "venv_groups",
]
