"""Push: validate bundles (integrity, against the identity they record), then one hub commit.

The builder may not have the model a bundle is for, so push checks each bundle with
`recorded_identity(manifest)`: every file, checksum, the layout and every byte, but not the
fingerprints (pull checks those against the model it deploys to).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.distribute.hub import REPO_TYPE, connect, hub_errors
from pipeline.distribute.pinned import FileId, file_ids
from pipeline.format.bundle_folder import CACHE_FILE, model_folder, read_manifest
from pipeline.format.errors import PipelineError
from pipeline.format.validate import recorded_identity, validate

OFFLINE_FIX = (
    "push where the hub is reachable (HF_HUB_OFFLINE unset, network up); nothing was pushed"
)
HELD_BACK = "valid, but not pushed: another bundle was refused (a push commits all or none)"


@dataclass(frozen=True)
class CheckedBundle:
    """A local bundle that passed the validator, and where it goes in the repo."""

    local: Path
    name: str
    version: int
    repo_path: str  # <name>/<version>/<slug>-<fingerprint[:12]>, as locally
    files: tuple[str, ...]
    cache_sha256: str
    tokens: int
    ids: tuple[tuple[str, FileId], ...] = ()  # each file's identity as validated (pinned.py)

    @property
    def label(self) -> str:
        return f"{self.name}@{self.version} ({self.repo_path.rsplit('/', 1)[1]})"


@dataclass(frozen=True)
class PushResult:
    repo: str
    revision: str
    commit: str | None
    url: str | None
    bundles: list[CheckedBundle]
    deleted: list[str]  # stale files removed from the pushed folders in the same commit


def check_bundle(bundle: Path, trust_memo: bool = False) -> CheckedBundle:
    """The full validator against the bundle's recorded identity; BundleError when refused
    (`trust_memo`: a cache file this user hashed in full, unchanged since, is not read again)."""
    bundle = Path(bundle)
    before = file_ids(bundle) if bundle.is_dir() else ()
    identity = recorded_identity(read_manifest(bundle, None))
    manifest = validate(bundle, identity, trust_memo=trust_memo).manifest
    ids = file_ids(bundle)
    if ids != before:  # rebuilt or edited meanwhile: what was validated is not what is there
        raise PipelineError(f"bundle {bundle}: it changed while it was validated; push it again")
    m = manifest
    return CheckedBundle(
        local=bundle,
        name=m.prefix.name,
        version=m.prefix.version,
        repo_path=f"{m.prefix.name}/{m.prefix.version}/{model_folder(m.model.slug, m.model.fingerprint)}",
        files=tuple(name for name, _ in ids),
        cache_sha256=m.cache.file_sha256,
        tokens=m.tokens.count,
        ids=ids,
    )


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
