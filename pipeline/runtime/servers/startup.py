"""What every `serve --server NAME` does before its server runs: mount, pin, check tokenization.

The bundles are validated by the one validator (pipeline.runtime.mount) and pinned into a
PromptCacheManager; each server's hook module then hands that manager's caches to the server's
own prompt cache.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.format.errors import PipelineError
from pipeline.runtime.hugepages import ensure_huge_pages
from pipeline.runtime.lookup import log_request
from pipeline.runtime.mount import MountedBundle, MountResult, model_bundles_dir, mount
from pipeline.runtime.prompt_cache import PromptCacheManager
from pipeline.runtime.serve import (
    check_mlx_lm,
    drop_unusable,
    live_remount,
    log_mounts,
    mount_options,
    passed_option,
)
from pipeline.runtime.servers.tokens import model_type, request_parity

log = logging.getLogger("prefix-bundles")
BUNDLE_KEY = "bundles"
__all__ = ["BUNDLE_KEY", "Mounted", "log_request", "mount_for", "start"]


@dataclass
class Mounted:
    """The bundles mounted for one served model, pinned in `manager` under BUNDLE_KEY."""

    model: Path
    manager: PromptCacheManager
    result: MountResult
    chat_template: str | None = None  # the template text the server was given, if not the model's
    strict: bool = False  # --strict: a bundle the server will not reuse whole is refused
    # {bundle name: tokens the server's request code keeps}, as check_tokenization found
    reusable: dict[str, int] = field(default_factory=dict)

    def covered(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of a request the best pinned bundle can serve (no copy)."""
        return self.manager.covered(BUNDLE_KEY, tokens)


def require(module: str, server: str) -> None:
    """PipelineError unless the server's package is importable here."""
    if importlib.util.find_spec(module) is None:
        raise PipelineError(
            f"serve --server {server}: {server} is not installed in this Python environment "
            f"({module} cannot be imported); install it with "
            f"\"pip install 'mlx-prefix-bundles[{server}]'\" (docs/servers.md)"
        )


def refuse_options(rest: list[str], server: str, options: dict[str, str]) -> None:
    """PipelineError for a passed-through server option this hook cannot honour."""
    for option, why in options.items():
        if any(a == option or a.startswith(option + "=") for a in rest):
            raise PipelineError(f"serve --server {server}: {option} is not supported: {why}")


def setup_logging(level: str | None) -> None:
    logging.basicConfig(
        level=getattr(logging, (level or "INFO").upper(), logging.INFO),
        format="%(asctime)s - %(levelname)s - %(message)s",
    )


def mount_for(
    args: argparse.Namespace,
    chat_template: str | None = None,
    unusable: Callable[[MountedBundle], str | None] | None = None,
    live: bool = True,
) -> Mounted:
    """Validate and mount the bundles for args.model, drop those the server would not use
    (`unusable` says why), log them; PipelineError under --strict. `live`: this process serves
    from them, so SIGHUP and --admin-port re-mount them (serve.live_remount)."""
    if args.bundles is None:
        args.bundles = model_bundles_dir(args.model)
    check_mlx_lm()
    manager = PromptCacheManager()
    options = mount_options(args, chat_template)
    result = mount(
        args.model,
        args.bundles,
        skip_refused=not args.strict,
        manager=manager,
        model_key=BUNDLE_KEY,
        **options(),
    )
    if unusable is not None:
        drop_unusable(result, manager, unusable)
    log_mounts(result)
    if args.strict and result.unused:
        path, reason = result.unused[0]
        raise PipelineError(f"--strict: bundle {path} would not be used: {reason}")
    if args.strict and not result.bundles:
        raise PipelineError(f"--strict: no bundle for {args.model} was found in {args.bundles}")
    if live:
        live_remount(args, result, manager, options, unusable or (lambda b: None))
    return Mounted(Path(args.model), manager, result, chat_template, args.strict)


def start(
    args: argparse.Namespace,
    rest: list[str],
    argv: list[str],
    chat_template: str | None = None,
    unusable: Callable[[MountedBundle], str | None] | None = None,
    live: bool = True,
) -> Mounted:
    """Logging, huge pages (may re-execute), then mount: the common start of every hook. The
    bundles are checked against `chat_template` (text) or the one --chat-template passes."""
    setup_logging(passed_option(rest, "--log-level"))
    ensure_huge_pages(args.huge_pages, argv)
    template = chat_template or passed_option(rest, "--chat-template")
    return mount_for(args, template, unusable, live)


def check_tokenization(server: str, mounted: Mounted) -> dict[str, int]:
    """Run each bundle's recorded request (its prefix and a user turn) through `server`'s own
    request code (or, for bundles without one, re-encode its text the server's way); one warning
    per bundle the server's first request will not reuse whole, PipelineError under --strict
    (`mounted.strict`).
    Returns {bundle name: tokens the server can reuse}, also kept as `mounted.reusable`."""
    tokenizer = server_tokenizer(mounted)
    kind = model_type(mounted.model)
    reusable = mounted.reusable
    for b in mounted.result.bundles:
        try:
            p = request_parity(server, tokenizer, b, kind)
        except PipelineError as exc:  # the server refuses the recorded request (another API)
            p = None
            line = f"{b.name}: not checked against {server}'s own request code: {exc}"
        if p is not None:
            reusable[b.name] = p.reusable
            if p.reason is None:
                continue
            line = f"{b.name}: requests will reuse at most {p.reusable} of its {p.total} tokens: {p.reason}"
        if mounted.strict:
            raise PipelineError(f"--strict: bundle {b.path}: {line}")
        log.warning("%s", line)
    return reusable


def server_tokenizer(mounted: Mounted) -> Any:
    """mlx-lm's tokenizer of the served model, with the template the server was given."""
    from mlx_lm.utils import load_tokenizer

    extra = {"chat_template": mounted.chat_template} if mounted.chat_template else None
    return load_tokenizer(mounted.model, tokenizer_config_extra=extra)
