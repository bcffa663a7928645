"""What the destination already holds for a pull: bundles that are up to date with an artifact,
and blocks of cache files found by their bytes' digest.

Local folders are read as the validator reads files (regular files only, opened without
blocking and without following a link): a FIFO, a device, a link or a huge file is never waited
on, and a folder that cannot be read is skipped for reuse with its reason kept.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from pipeline.distribute.artifact import Blob
from pipeline.distribute.blocks import Layout, Source, peer_tokens, read_layout
from pipeline.format.bundle_folder import CACHE_FILE, STAGING_DIR
from pipeline.format.errors import BundleError, PipelineError
from pipeline.format.regular_files import FileProblem, read_regular
from pipeline.format.signature import PublicKey
from pipeline.format.validate import validate

NEVER = 1 << 62  # no block is known to differ


def up_to_date(
    folder: Path, files: Sequence[Blob], identity, keys: tuple[PublicKey, ...]
) -> int | None:
    """The bundle's token count when `folder` holds exactly the artifact's small files (each
    with its digest) and its cache file passes the one validator for this model (with `keys`:
    signed by one); None when it must be pulled (absent, other files, or refused)."""
    if folder.is_symlink() or not folder.is_dir():
        return None
    try:
        names = {p.name for p in folder.iterdir()}
        if names != {f.title for f in files} | {CACHE_FILE}:
            return None
        for f in files:
            data = read_regular(folder / str(f.title), f.size, follow=False)
            if "sha256:" + hashlib.sha256(data).hexdigest() != f.digest:
                return None
        # the manifest pins the cache file; a file this user hashed, unchanged since, is not
        # read again (the memo), any other is read once
        found = validate(folder, identity, trusted_keys=keys, trust_memo=True)
    except (OSError, FileProblem, PipelineError):  # BundleError included: pulled again
        return None
    return found.manifest.tokens.count


class LocalBlocks:
    """Blocks of the cache files already in a bundles folder (and of those this pull staged),
    found by their bytes' digest; thread-safe: several blocks are looked for at once. A folder
    that cannot be read is skipped for reuse, its reason kept in `unusable`."""

    def __init__(self, root: Path) -> None:
        found = sorted(root.glob(f"*/*/*/{CACHE_FILE}")) if root.is_dir() else []
        self.files = [p for p in found if STAGING_DIR not in p.parts and _in_layout(root, p)]
        # by (file, block size): blocks are cut with the size the remote artifact records
        self.opened: dict[tuple[Path, int], Source | None] = {}
        # (artifact, file) -> first block known to differ: a continuation shares a prefix, so no
        # later block of that file matches that artifact (never carried to another artifact)
        self.differs: dict[tuple[str, Path], int] = {}
        self.unusable: dict[Path, str] = {}  # bundle folder -> why its blocks are not reused
        self.lock = threading.Lock()

    def offer(self, path: Path, plan: Layout) -> None:
        """A cache file this pull rebuilt and checked: a source for the artifacts after it."""
        with self.lock:
            self.opened[path, plan.block_tokens] = Source(path, plan)
            self.files.insert(0, path)

    def _source(self, path: Path, b: int) -> Source | None:
        """The file open for blocks of b tokens, or None when unusable."""
        with self.lock:
            if (path, b) not in self.opened:
                self.opened[path, b] = None
                try:
                    plan = read_layout(path, peer_tokens(path.parent), block_size=b)
                    self.opened[path, b] = Source(path, plan)
                except BundleError as exc:  # names the file and what it is
                    self.unusable.setdefault(path.parent, exc.reason)
                except (OSError, ValueError) as exc:  # not a cache file blocks can be cut from
                    why = exc.strerror if isinstance(exc, OSError) else str(exc)
                    self.unusable.setdefault(path.parent, f"{CACHE_FILE} {why}")
            return self.opened[path, b]

    def fill(
        self, artifact: str, plan: Layout, k: int, blob: Blob, write: Callable[[bytes], None]
    ) -> bool:
        """Write block k of `artifact` from a local file holding the same bytes; False when none
        does."""
        for path in self.files:
            source = self._source(path, plan.block_tokens)
            if source is None or k >= self.differs.get((artifact, path), NEVER):
                continue
            if not source.plan.compatible(plan) or k >= source.plan.blocks:
                continue
            data = source.block(k)
            if (
                len(data) == blob.size
                and "sha256:" + hashlib.sha256(data).hexdigest() == blob.digest
            ):
                write(data)
                return True
            with self.lock:
                key = (artifact, path)
                self.differs[key] = min(k, self.differs.get(key, NEVER))
        return False

    def close(self) -> None:
        for source in self.opened.values():
            if source:
                source.close()


def _in_layout(root: Path, cache_file: Path) -> bool:
    """A cache file at <root>/<name>/<version>/<folder>/ reached through real folders only."""
    folder = cache_file.parent
    return not any(p.is_symlink() for p in (folder, folder.parent, folder.parent.parent))
