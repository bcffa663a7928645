"""`serve`: mlx_lm.server with bundles mounted; options it does not know go to the server."""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

from pipeline.cli.common import err
from pipeline.cli.keys import add_trusted_key_option
from pipeline.cli.parser import nonempty
from pipeline.format.errors import PipelineError
from pipeline.runtime.hugepages import CHOICES, DEFAULT_HUGE_PAGES
from pipeline.runtime.servers.registry import names as server_names


def add_parser(sub: argparse._SubParsersAction, parents: list) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        parents=parents,
        help="mlx_lm.server (or --server NAME) with bundles mounted (serve --help for options)",
        description="mlx_lm.server (or another server, --server) with prefix bundles mounted in "
        "its prompt cache at startup. Options not listed here are passed to that server unchanged.",
        allow_abbrev=False,  # a server option must never be taken for an abbreviation of ours
    )
    p.add_argument(
        "--model",
        type=nonempty,
        required=True,
        help="the MLX model folder the bundles were built for",
    )
    p.add_argument(
        "--server",
        choices=server_names(),
        default=server_names()[0],
        help="the server to run with the bundles in its own prompt cache (default: mlx-lm, i.e. "
        "mlx_lm.server; the others need their package: docs/servers.md)",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="exit non-zero when any bundle is refused or none is mounted",
    )
    p.add_argument(
        "--verify-full",
        action="store_true",
        help="hash every cache file in full, even one this user already verified unchanged",
    )
    p.add_argument(
        "--warm-up",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="after loading the model and before the port opens, send the longest mounted "
        "bundle's request through the server's own generation path once (mlx_lm.server: one decode "
        "step from it), so the first client pays what an in-memory hit costs; it leaves no cache "
        "entry behind (default: on, but off for mlx-openai-server, where it was measured not to "
        "pay; --no-warm-up skips it)",
    )
    p.add_argument(
        "--lockfile",
        type=Path,
        help="mount the versions this prefixes.lock names instead of the newest",
    )
    p.add_argument(
        "--huge-pages",
        choices=CHOICES,
        default=DEFAULT_HUGE_PAGES,
        help="on: restart serve with GLIBC_TUNABLES=glibc.malloc.hugetlb=1, so malloc uses "
        f"transparent huge pages (Linux with glibc 2.35+; default: {DEFAULT_HUGE_PAGES})",
    )
    p.add_argument(
        "--admin-port",
        type=int,
        metavar="N",
        help="also listen on 127.0.0.1:N for POST /v1/bundles/remount (re-read --bundles, as "
        "SIGHUP does, answered with a JSON report) and GET /v1/bundles (default: off)",
    )
    p.add_argument(
        "--admin-token-file",
        type=Path,
        metavar="FILE",
        help="require 'Authorization: Bearer <the file's first line>' on the admin endpoint",
    )
    p.add_argument(
        "--snapshots",
        type=Path,
        metavar="DIR",
        help="spill the server's hottest prompt-cache entries to DIR while it serves (see "
        "--snapshot-every; a kill -9 keeps the last spill) and save them at a graceful stop "
        "(SIGTERM, SIGINT), signed with this host's key; mounted at the next start through the "
        "same validator; every server serve wraps (they hold client prompts: docs/snapshots.md; "
        "default: off)",
    )
    p.add_argument(
        "--snapshot-budget",
        metavar="SIZE",
        help="the most KV bytes --snapshots writes in one set (each spill and the stop's save), "
        "hottest entries first (e.g. 512MiB; default: 2GiB)",
    )
    p.add_argument(
        "--bundle-memory",
        metavar="SIZE",
        help="the most memory the mounted bundles hold (e.g. 2GiB; a preamble several bundles "
        "share counts once); the others wait on disk, validated, and are read on a hit, the "
        "least recently hit moved back to disk (docs/servers.md; default: every bundle held)",
    )
    p.add_argument(
        "--snapshot-every",
        metavar="MINUTES",
        help="with --snapshots, the least time between two spills while serving: a spill starts "
        "once the server stored something new and has been quiet for 2 s, or a change waited "
        "MINUTES; off the request path (a request waits only for a ~1 ms capture of the entries "
        "on the thread that stored one; a thread of its own writes them; a failed spill keeps "
        "the previous set); every server (default: 0.5, i.e. 30 s; 0 or off: saved at a "
        "graceful stop only)",
    )
    add_trusted_key_option(p)  # each refusal is logged and serve goes on; --strict exits 1
    # unknown options belong to the server; bundles default to <model>/prefix-bundles, else the
    # project's bundles/ (pipeline.runtime.mount.reading_bundles_dir)
    p.set_defaults(func=run, passes_through=True, bundles_near_model="read")
    return p


def run(args: argparse.Namespace) -> int:
    """Mount (the global --bundles, default <model>/prefix-bundles), then run the server.

    Once serve has said `error:`, the process ends with status 1 even when the server started
    threads that would keep it alive (mlx_lm.server's generation thread is not a daemon): a
    supervisor must see a failed service, never one that holds the model and serves nothing."""
    from pipeline.runtime.serve import serve
    from pipeline.runtime.servers.startup import SERVED

    SERVED.clear()  # set by this serve's start-up once its server runs
    # ended here, not by the interpreter's teardown, when this is the process's command line
    ours = lambda: SERVED.is_set() and getattr(args, "own_process", False)  # noqa: E731
    try:
        code = serve(args, args.passthrough, args.argv)
    except (PipelineError, OSError) as exc:
        if not (_lingering_threads() or ours()):
            raise
        err(
            str(exc)
            if isinstance(exc, PipelineError)
            else f"{exc.filename or 'I/O'}: {exc.strerror or exc}"
        )
        _exit_now(1)
    except KeyboardInterrupt:
        if not ours():
            raise
        _exit_now(130)
    if ours():  # a stop's status, not a teardown's SIGABRT, is what a supervisor sees
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """End the process with `code`, logs and output flushed, without the interpreter's teardown."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _lingering_threads() -> list[threading.Thread]:
    """Threads that would keep the process alive after the main thread returns."""
    main = threading.main_thread()
    return [t for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive()]
