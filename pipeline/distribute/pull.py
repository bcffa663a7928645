"""Pull from a hub repo: the bundle folders that fit a local model, downloaded at one commit
into a staging folder, then the pull's end (publish.publish_staged: validated, all or none).

Only folders whose name carries the local model's fingerprint are downloaded (selection.select),
into <bundles>/.staging/<pid>-<random>/; a stray file in a chosen folder is refused before any
download.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from pipeline.builder.writer import clean_staging, discard, new_staging_folder
from pipeline.distribute.hub import REPO_TYPE, connect, hub_errors, remote_bundles
from pipeline.distribute.publish import PullResult, disk_error, publish_staged
from pipeline.distribute.selection import check_found, near_model, parse_wanted, select
from pipeline.format.bundle_folder import ALLOWED_FILES, FINGERPRINT_CHARS
from pipeline.format.errors import PipelineError
from pipeline.format.served_identity import identity_for
from pipeline.format.signature import PublicKey

OFFLINE_FIX = (
    "pull where the hub is reachable (HF_HUB_OFFLINE unset, network up), or copy the bundles into "
    "{bundles} by hand and run 'prefix-bundles verify --model {model}'"
)


def pull(
    repo: str,
    model_dir: Path,
    bundles_dir: Path | None = None,
    revision: str | None = None,
    prefixes: list[str] | None = None,
    trusted_keys: Sequence[PublicKey] = (),
    locked: Mapping[str, str | None] | None = None,
) -> PullResult:
    """Download, validate and publish the bundles of `repo` that fit the model in `model_dir`.

    With trusted_keys each must carry a valid signature by one of them (it is published with it);
    `locked` (locked_selection): exactly the folders a lockfile names, at the resolved commit."""
    model_dir = Path(model_dir)
    root = Path(bundles_dir) if bundles_dir is not None else near_model(model_dir)
    wanted = parse_wanted(prefixes)
    identity = identity_for(model_dir)  # a bad model folder fails here, before the network
    fix = OFFLINE_FIX.format(bundles=root, model=model_dir)
    api = connect(repo, "pull from", fix)
    with hub_errors(repo, revision, "pull from"):
        commit = api.repo_info(repo, revision=revision, repo_type=REPO_TYPE).sha
        files = api.list_repo_files(repo, revision=commit, repo_type=REPO_TYPE)
    endpoint = getattr(api, "endpoint", None)  # HfApi's host; None: no URL to give
    url = f"{endpoint.rstrip('/')}/{repo}/tree/{commit}" if endpoint else None
    result = PullResult(repo, revision or "main", commit, url, model_dir, root)
    chosen, result.skipped = select(remote_bundles(files), identity.model, wanted, locked)
    check_found(result, chosen, wanted, identity.model[:FINGERPRINT_CHARS], locked)
    for b in chosen:  # before any download: a stray file (of any size) is not fetched to refuse
        stray = sorted(f[len(b.path) + 1 :] for f in files if f.startswith(f"{b.path}/"))
        stray = [name for name in stray if name not in ALLOWED_FILES]
        if stray:
            raise PipelineError(
                f"hub repo {repo}: {b.path} holds {stray[0]!r}, not a bundle file (a bundle "
                f"holds {', '.join(sorted(ALLOWED_FILES))}); remove it from the repo or push the "
                "bundle again: nothing was published"
            )
    clean_staging(root)
    staging = new_staging_folder(root)
    try:
        with hub_errors(repo, revision, "pull from", disk_error=lambda e: disk_error(root, e)):
            api.snapshot_download(
                repo,
                repo_type=REPO_TYPE,
                revision=commit,
                allow_patterns=[f"{b.path}/{name}" for b in chosen for name in ALLOWED_FILES],
                local_dir=str(staging),
            )
        publish_staged(result, chosen, staging, identity, tuple(trusted_keys))
    finally:
        discard(root, staging)
    return result
