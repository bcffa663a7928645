"""The end of every pull, whatever the back end: each staged bundle validated against the model
by the one validator, then all published or none.

All or nothing: every target's build lock is taken first, then all are validated, then all are
moved into place with the builder's atomic exchange; a refused bundle, a lock held by another
build or a failed move publishes none (moves already made are undone). Every delete and rename
stays under the bundles folder and follows no link (pipeline.format.safe_tree).
"""

from __future__ import annotations

import errno
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import Timeout as LockTimeout

from pipeline.builder.writer import place, target_lock, unplace
from pipeline.distribute.selection import RemoteBundle, Skipped
from pipeline.format.errors import BundleError, PipelineError
from pipeline.format.validate import BlockProof, validate


@dataclass(frozen=True)
class PulledBundle:
    name: str
    version: int
    repo_path: str
    path: Path  # where it was published (or would have been)
    tokens: int


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
    proofs: dict[str, BlockProof] | None = None,
) -> None:
    """Lock every target, validate every staged bundle, then publish all or none (`trust_memo`:
    the caller hashed each cache file in full just now and recorded it in the memo; `proofs`:
    by repo path, the cache files whose every block the caller proved as it wrote them)."""
    root = result.bundles_dir
    with ExitStack() as held:  # every target locked before anything is checked or moved
        busy = {b.path for b in chosen if not _lock(root / b.path, root, held)}
        validated = _validate_all(result, chosen, staging, identity, keys, trust_memo, proofs or {})
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
    proofs: dict[str, BlockProof] | None = None,
) -> list[tuple[RemoteBundle, int]]:
    """(bundle, tokens) of every downloaded bundle the real validator accepts (every byte
    proven: hashed, or its blocks as they landed); the others go to result.refused."""
    validated = []
    for b in chosen:
        try:
            proof = (proofs or {}).get(b.path)
            v = validate(
                staging / b.path, identity, trusted_keys=keys, trust_memo=trust_memo, proof=proof
            )
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
