"""Pull: the bundles of a hub repo that fit a local model, validated, then published atomically.

Only folders whose name carries the local model's fingerprint are downloaded (per prefix the
highest version, or the ones asked for), into <bundles>/.staging/<pid>-<random>/. Each is checked
against the model by the real validator (every byte hashed). All or nothing: every target's
build lock is taken first, then all are validated, then all are moved into place with the
builder's atomic exchange; a refused bundle, a lock held by another build or a failed move
publishes none (moves already made are undone). Every delete and rename stays under the bundles
folder and follows no link (pipeline.format.safe_tree).
"""

from __future__ import annotations

import errno
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import Timeout as LockTimeout

from pipeline.builder.writer import (
    clean_staging,
    discard,
    new_staging_folder,
    place,
    target_lock,
    unplace,
)
from pipeline.distribute.hub import REPO_TYPE, RemoteBundle, connect, hub_errors, remote_bundles
from pipeline.format.bundle_folder import ALLOWED_FILES, FINGERPRINT_CHARS
from pipeline.format.errors import BundleError, PipelineError
from pipeline.format.names import NAME_HINT, parse_ref
from pipeline.format.served_identity import identity_for
from pipeline.format.signature import PublicKey
from pipeline.format.validate import validate

OFFLINE_FIX = (
    "pull where the hub is reachable (HF_HUB_OFFLINE unset, network up), or copy the bundles into "
    "{bundles} by hand and run 'python build.py verify --model {model}'"
)


@dataclass(frozen=True)
class PulledBundle:
    name: str
    version: int
    repo_path: str
    path: Path  # where it was published (or would have been)
    tokens: int


@dataclass(frozen=True)
class Skipped:
    name: str
    version: int
    repo_path: str
    reason: str
    path: Path | None = None  # where it would have been published (a valid bundle held back)
    tokens: int | None = None  # set once validated


@dataclass(frozen=True)
class Refused:
    name: str
    version: int
    repo_path: str
    path: Path  # where it would have been published
    error: BundleError  # names the repo path and the commit; .check is the validator's stage


HELD_BACK = "valid, but not published: another bundle was refused (a pull publishes all or none)"
HELD_BACK_FAILED = (
    "valid, but not published: another bundle could not be published (a pull publishes all or none)"
)
BUSY = "another build or pull is writing {} right now; pull again later"


@dataclass(frozen=True)
class Failed:
    """A valid bundle that could not be published (its lock held, or the move failed)."""

    name: str
    version: int
    repo_path: str
    path: Path
    tokens: int
    reason: str


@dataclass
class PullResult:
    repo: str
    revision: str  # as asked (default main)
    commit: (
        str | None
    )  # the commit it resolved to (hub; None for OCI): listing and download read it
    url: str | None  # the repo's files at that commit on the hub, when the client names its host
    model: Path
    bundles_dir: Path
    pulled: list[PulledBundle] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    refused: list[Refused] = field(default_factory=list)  # non-empty: nothing was published
    failed: list[Failed] = field(default_factory=list)  # non-empty: nothing was published
    digests: dict[str, str] = field(default_factory=dict)  # OCI: repo_path -> artifact digest
    transfer: Any = None  # OCI: the bytes moved and reused (oci_push.Transfer)
    transfers: dict[str, Any] = field(default_factory=dict)  # OCI: repo_path -> its Transfer
    current: list[PulledBundle] = field(default_factory=list)  # OCI: up to date, left as they are
    by_tag: list[str] = field(default_factory=list)  # lockfile paths with no digest: fetched by tag
    notes: list[str] = field(default_factory=list)  # bundles here not reused for blocks, and why

    @property
    def source(self) -> str:
        """Where the bundles came from, as a refusal names it."""
        if self.commit is None:
            return f"registry repo {self.repo}"
        return f"hub repo {self.repo}@{self.commit[:12]}"


def parse_wanted(prefixes: list[str] | None) -> dict[str, int | None] | None:
    """--prefix NAME or NAME@VERSION -> {name: version or None (highest)}."""
    if not prefixes:
        return None
    wanted: dict[str, int | None] = {}
    for item in prefixes:
        ref = parse_ref(item)
        if ref is None:
            raise PipelineError(
                f"--prefix {item!r}: pass NAME or NAME@VERSION (e.g. shop@2; the name {NAME_HINT}, "
                "the version ASCII digits)"
            )
        wanted[ref[0]] = ref[1]
    return wanted


def locked_selection(lockfile: Path, model_dir: Path) -> dict[str, str | None]:
    """What a lockfile pins for this model: {repo path <name>/<version>/<model folder>: the
    artifact digest `push --lockfile` recorded, or None (fetched by tag)}; exactly the folders
    it names, never a sibling folder of the same version and fingerprint."""
    from pipeline.format.lockfile import given_lock

    lock = given_lock(Path(lockfile))
    fingerprint = identity_for(Path(model_dir)).model
    locked: dict[str, str | None] = {}
    for name, entry in sorted(lock.prefixes.items()):
        for folder, fp in sorted(entry.models.items()):
            if fp == fingerprint:
                locked[f"{name}/{entry.version}/{folder}"] = (entry.artifacts or {}).get(folder)
    if not locked:
        raise PipelineError(
            f"{lockfile}: no prefix is locked for the model {model_dir} (fingerprint "
            f"{fingerprint[:FINGERPRINT_CHARS]}); build for it and commit the lockfile, or pull "
            "without --lockfile"
        )
    return locked


def near_model(model_dir: Path) -> Path:
    """<model>/prefix-bundles (pipeline.runtime, imported only here: numpy and the serving path
    cost a pull ~0.15 s that names its --bundles)."""
    from pipeline.runtime.mount import model_bundles_dir

    return model_bundles_dir(Path(model_dir))


def select(
    remote: list[RemoteBundle],
    fingerprint: str,
    wanted: dict[str, int | None] | None,
    locked: Mapping[str, str | None] | None = None,
) -> tuple[list[RemoteBundle], list[Skipped]]:
    """(to pull, skipped with why): this model's folders, per prefix the highest or asked version;
    with `locked` (a lockfile's repo paths) exactly the folders it names."""
    fp = fingerprint[:FINGERPRINT_CHARS]
    mine = [b for b in remote if b.fingerprint == fp]
    skipped = [
        Skipped(b.name, b.version, b.path, f"for another model ({b.fingerprint})")
        for b in remote
        if b not in mine
    ]
    if locked is not None:
        chosen = [b for b in mine if b.path in locked]
        why = "not named by the lockfile (it pins exactly the folders it names)"
        return chosen, skipped + [
            Skipped(b.name, b.version, b.path, why) for b in mine if b not in chosen
        ]
    best: dict[str, int] = {}
    for b in mine:
        if wanted is None or (b.name in wanted and wanted[b.name] in (None, b.version)):
            best[b.name] = max(best.get(b.name, 0), b.version)
    chosen = [b for b in mine if best.get(b.name) == b.version]
    for b in mine:
        if b not in chosen:
            highest = wanted is None or (b.name in wanted and wanted[b.name] is None)
            why = "older version" if highest else "not asked for"
            skipped.append(Skipped(b.name, b.version, b.path, why))
    return chosen, skipped


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


DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EACCES, errno.EPERM}


def disk_error(root: Path, exc: OSError, kept: str = "") -> PipelineError | None:
    """A write under the bundles folder that failed (a full disk, a read-only mount, a quota):
    one line naming the folder and what to do; None for any other OSError (a network error)."""
    if exc.errno not in DISK_ERRORS:
        return None
    return PipelineError(
        f"cannot write under {root} ({exc.strerror}): free space there (or make it writable) "
        f"and pull again{kept}; nothing was published"
    )


def publish_staged(
    result: PullResult,
    chosen: list[RemoteBundle],
    staging: Path,
    identity,
    keys: tuple = (),
    trust_memo: bool = False,
) -> None:
    """Lock every target, validate every staged bundle, then publish all or none (`trust_memo`:
    the caller hashed each cache file in full just now and recorded it in the memo)."""
    root = result.bundles_dir
    with ExitStack() as held:  # every target locked before anything is checked or moved
        busy = {b.path for b in chosen if not _lock(root / b.path, root, held)}
        validated = _validate_all(result, chosen, staging, identity, keys, trust_memo)
        if not (result.refused or busy):
            _publish_all(result, staging, validated)
        else:
            _hold_back(result, validated, busy)


def _lock(dest: Path, root: Path, held: ExitStack) -> bool:
    """Take dest's build lock for the rest of the pull; False when another build holds it."""
    try:
        held.enter_context(target_lock(root, dest))
    except LockTimeout:
        return False
    return True


def _validate_all(
    result: PullResult,
    chosen: list[RemoteBundle],
    staging: Path,
    identity,
    keys: tuple = (),
    trust_memo: bool = False,
) -> list[tuple[RemoteBundle, int]]:
    """(bundle, tokens) of every downloaded bundle the real validator accepts (every byte
    hashed); the others go to result.refused."""
    validated = []
    for b in chosen:
        try:
            v = validate(staging / b.path, identity, trusted_keys=keys, trust_memo=trust_memo)
            validated.append((b, v.manifest.tokens.count))
        except BundleError as exc:
            where = f"{b.path} from {result.source}"
            error = BundleError(where, exc.reason, exc.field)
            error.check = exc.check
            result.refused.append(
                Refused(b.name, b.version, b.path, result.bundles_dir / b.path, error)
            )
    return validated


def _hold_back(
    result: PullResult, validated: list[tuple[RemoteBundle, int]], busy: set[str]
) -> None:
    """Nothing is published: each valid bundle is held back or, its lock taken, failed."""
    root = result.bundles_dir
    for b, tokens in validated:
        dest = root / b.path
        if b.path in busy:
            result.failed.append(Failed(b.name, b.version, b.path, dest, tokens, BUSY.format(dest)))
        else:
            why = HELD_BACK if result.refused else HELD_BACK_FAILED
            result.skipped.append(Skipped(b.name, b.version, b.path, why, dest, tokens))


def _publish_all(
    result: PullResult, staging: Path, validated: list[tuple[RemoteBundle, int]]
) -> None:
    """Publish every bundle or, when one cannot be, put back what was placed and publish none."""
    root, placed = result.bundles_dir, []
    for b, tokens in validated:
        try:
            placed.append((b, place(root, staging / b.path, root / b.path)))
        except (OSError, PipelineError) as exc:
            for done, replaced in reversed(placed):
                unplace(root, staging / done.path, root / done.path, replaced)
            reason = f"cannot publish it ({error_text(exc)})"
            result.failed.append(Failed(b.name, b.version, b.path, root / b.path, tokens, reason))
            _hold_back(result, [v for v in validated if v[0] != b], set())
            return
    for b, tokens in validated:
        result.pulled.append(PulledBundle(b.name, b.version, b.path, root / b.path, tokens))


def error_text(exc: Exception) -> str:
    """One line for an OSError or a PipelineError."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename or ''}: {exc.strerror}".lstrip(": ")
    return " ".join(str(exc).split())


def check_found(
    result: PullResult,
    chosen: list[RemoteBundle],
    wanted: dict[str, int | None] | None,
    fp: str,
    locked: Mapping[str, str | None] | None = None,
) -> None:
    """Pulling nothing, or less than a lockfile names, is an error: say what the repo has and how
    to get a bundle for this model."""
    where = result.source if result.commit is None else f"hub repo {result.repo}@{result.revision}"
    absent = sorted(set(locked or {}) - {b.path for b in chosen})
    if absent:
        raise PipelineError(
            f"{where}: no bundle {absent[0]}, which the lockfile pins for this model (fingerprint "
            f"{fp}); push it ('python build.py push ... --lockfile'), or pull with the lockfile of "
            "what was pushed: nothing was published"
        )
    missing = sorted(set(wanted or {}) - {b.name for b in chosen})
    if missing:
        asked = ", ".join(f"{n}@{wanted[n]}" if wanted[n] else n for n in missing)
        raise PipelineError(
            f"{where}: no bundle of {asked} for this model (fingerprint {fp}); build and push it "
            f"('python build.py build --model {result.model}', then push)"
        )
    if not chosen:
        raise PipelineError(
            f"{where}: no bundle for this model (fingerprint {fp}) among {len(result.skipped)} "
            f"bundle(s); build and push them ('python build.py build --model {result.model}', "
            "then push)"
        )
