"""vllm-mlx's requests bound to their usage record (pipeline.runtime.servers.usage): its engines
look a request up on a worker thread, so each engine's runner carries the request's `Reuse` there
(SimpleEngine's serialized runner, the batched engine's admission), and SimpleEngine's own
system-prompt snapshots are noted on it."""

from __future__ import annotations

import inspect
import uuid
from typing import Any

from pipeline.runtime.servers.usage import CURRENT, Reuse, on_worker, worker_reuse


def note_system_ids(ids: list[int]) -> None:
    """In the request's context: the system prefix the server's own snapshot cache would keep."""
    reuse = CURRENT.get()
    if reuse is not None:
        reuse.system_ids = list(ids)


def worker_system_ids() -> list[int] | None:
    """On the generation worker: the running request's system prefix ids (note_system_ids)."""
    reuse = worker_reuse()
    return None if reuse is None else reuse.system_ids


def bind_runs(engine_class: type, method: str) -> None:
    """engine_class.<method>(func, ...) (an async runner that calls func on the worker thread)
    binds the calling request's Reuse to the worker thread while func runs."""
    original = getattr(engine_class, method)

    async def run(self: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        reuse = CURRENT.get()
        if reuse is None:
            return await original(self, func, *args, **kwargs)

        def bound(*fargs: Any, **fkwargs: Any) -> Any:
            with on_worker(reuse):
                return func(*fargs, **fkwargs)

        return await original(self, bound, *args, **kwargs)

    setattr(engine_class, method, run)


def bind_requests(core_class: type, scheduler_class: type) -> None:
    """For an engine whose lookup runs when its scheduler admits a request (vllm-mlx's
    continuous batching): core_class.add_request (async, in the request's context) files the
    request's Reuse under its request id; scheduler_class.add_request (on the worker) binds it
    while the request is admitted."""
    pending: dict[str, Reuse] = {}
    add = core_class.add_request
    signature = inspect.signature(add)

    async def add_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        reuse = CURRENT.get()
        if reuse is None:
            return await add(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        request_id = bound.arguments.get("request_id") or str(uuid.uuid4())
        bound.arguments["request_id"] = request_id
        pending[request_id] = reuse
        try:
            return await add(*bound.args, **bound.kwargs)
        finally:
            pending.pop(request_id, None)

    admit = scheduler_class.add_request

    def admit_request(self: Any, request: Any) -> Any:
        with on_worker(pending.get(getattr(request, "request_id", None))):
            return admit(self, request)

    core_class.add_request = add_request
    scheduler_class.add_request = admit_request


__all__ = ["bind_requests", "bind_runs", "note_system_ids", "worker_system_ids"]
