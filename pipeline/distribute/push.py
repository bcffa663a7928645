"""Push to a hub repo: bundles checked (checked.check_bundle), then one hub commit."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.distribute.checked import CheckedBundle
from pipeline.distribute.hub import REPO_TYPE, connect, hub_errors
from pipeline.format.bundle_folder import CACHE_FILE
from pipeline.format.errors import PipelineError

OFFLINE_FIX = (
    "push where the hub is reachable (HF_HUB_OFFLINE unset, network up); nothing was pushed"
)
HELD_BACK = "valid, but not pushed: another bundle was refused (a push commits all or none)"


@dataclass(frozen=True)
class PushResult:
    repo: str
    revision: str
    commit: str | None
    url: str | None
    bundles: list[CheckedBundle]
    deleted: list[str]  # stale files removed from the pushed folders in the same commit


def commit_message(bundles: list[CheckedBundle]) -> tuple[str, str]:
    """(title naming the bundles, description with each cache file's sha256)."""
    title = "Push prefix bundles: " + ", ".join(b.label for b in bundles)
    if len(title) > 200:
        title = f"Push {len(bundles)} prefix bundles: " + ", ".join(
            f"{b.name}@{b.version}" for b in bundles
        )
    body = "\n".join(f"{b.repo_path}: {CACHE_FILE} sha256 {b.cache_sha256}" for b in bundles)
    return title[:400], body


def push(bundles: list[CheckedBundle], repo: str, revision: str | None = None) -> PushResult:
    """Upload validated bundles into <name>/<version>/<folder>/ of `repo` in one commit."""
    seen: dict[str, Path] = {}
    for b in bundles:
        if b.repo_path in seen:
            raise PipelineError(
                f"{seen[b.repo_path]} and {b.local} are both {b.repo_path}; push one of them"
            )
        seen[b.repo_path] = b.local
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    api = connect(repo, "push to", OFFLINE_FIX)
    with hub_errors(repo, revision, "push to"):
        if revision not in (None, "main"):
            api.create_branch(repo, branch=revision, repo_type=REPO_TYPE, exist_ok=True)
        existing = api.list_repo_files(repo, revision=revision, repo_type=REPO_TYPE)
        added = {f"{b.repo_path}/{name}": b.local / name for b in bundles for name in b.files}
        stale = sorted(
            p
            for p in existing
            if p not in added and any(p.startswith(b.repo_path + "/") for b in bundles)
        )
        operations = [
            CommitOperationAdd(path_in_repo=path, path_or_fileobj=str(local))
            for path, local in sorted(added.items())
        ] + [CommitOperationDelete(path_in_repo=path) for path in stale]
        title, body = commit_message(bundles)
        info = api.create_commit(
            repo,
            operations=operations,
            commit_message=title,
            commit_description=body,
            revision=revision,
            repo_type=REPO_TYPE,
        )
    return PushResult(
        repo,
        revision or "main",
        getattr(info, "oid", None),
        getattr(info, "commit_url", None),
        list(bundles),
        stale,
    )
