"""The fleet's hub repo: its bundle layout, a client that fails fast, hub errors as one line."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pipeline.distribute.selection import RemoteBundle
from pipeline.format.errors import PipelineError
from pipeline.format.names import is_model_folder, is_name, parse_version
from pipeline.hubnet import require_hub

REPO_TYPE = "model"  # bundles live in a (private) model repo: the hub's plain file store
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*\Z")


def remote_bundles(files: list[str]) -> list[RemoteBundle]:
    """The bundle folders among a repo's files; anything outside the layout is ignored."""
    found: dict[tuple[str, int, str], list[str]] = {}
    for path in files:
        parts = path.split("/")
        if len(parts) != 4:
            continue
        name, version, folder, file = parts
        number = parse_version(version)
        if is_name(name) and number is not None and is_model_folder(folder) and file:
            found.setdefault((name, number, folder), []).append(file)
    return [RemoteBundle(n, v, f, tuple(sorted(fs))) for (n, v, f), fs in sorted(found.items())]


def check_repo_id(repo: str) -> str:
    if not REPO_ID.match(repo):
        raise PipelineError(f"--repo {repo!r} is not a hub repo id; pass it as ORG/NAME")
    return repo


def make_api() -> Any:
    """The hub client (tests put a folder-backed stand-in here)."""
    from huggingface_hub import HfApi

    return HfApi()


def connect(repo: str, doing: str, fix: str) -> Any:
    """A client for `repo`, after failing fast (one line, < 1 s) when the hub is unreachable."""
    check_repo_id(repo)
    require_hub(f"{doing} hub repo {repo}", fix)
    return make_api()


@contextmanager
def hub_errors(
    repo: str, revision: str | None, doing: str, disk_error: Any = lambda exc: None
) -> Iterator[None]:
    """Whatever the hub raises becomes one PipelineError naming the repo and what to do
    (`disk_error`: the line for a local write that failed, a full disk, else None)."""
    from huggingface_hub.errors import (
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{doing} hub repo {repo}"
    try:
        yield
    except PipelineError:
        raise
    except RevisionNotFoundError:
        raise PipelineError(
            f"{where}: revision {revision} not found; pass an existing branch, tag or commit "
            "with --revision"
        ) from None
    except RepositoryNotFoundError:
        raise PipelineError(
            f"{where}: repo not found or no access; check the name, create it (private) on the "
            "hub first, or set HF_TOKEN to a token with access to it"
        ) from None
    except HfHubHTTPError as exc:
        status = getattr(exc.response, "status_code", None)
        if status in (401, 403):
            raise PipelineError(
                f"{where}: not authorized (HTTP {status}); set HF_TOKEN to a token with "
                f"{'write' if doing.startswith('push') else 'read'} access to {repo}"
            ) from None
        detail = exc.server_message or str(exc).splitlines()[0]
        raise PipelineError(f"{where}: HTTP {status} ({detail[:160]}); retry later") from None
    except Exception as exc:  # transport errors and the rest: one line, never a traceback
        if isinstance(exc, OSError) and (local := disk_error(exc)) is not None:
            raise local from None
        detail = " ".join(str(exc).split())[:160]
        raise PipelineError(
            f"{where} failed ({exc.__class__.__name__}: {detail}); check the network and "
            "HF_TOKEN and retry"
        ) from None
