"""The serve layer, by server: each server serve wraps has a room here (`mlx_lm/`, `vllm_mlx/`,
...: its hook and everything only that server runs), listed once in `registry.py`; the shared
core (`startup.py`, `options.py`, `mounted.py`, `warm_up.py`, `tokens.py`) names no server, and
the shared cache families (`lru_cache.py`, `memory_cache.py`, `entries.py`, `usage.py`) serve
more than one room. pipeline.runtime.serve dispatches `serve --server NAME` here
(docs/architecture.md: adding a server)."""

from __future__ import annotations

from pipeline.runtime.servers.registry import hook_for, names

__all__ = ["hook_for", "names"]
