"""Write a bundle so that its final path always names a complete bundle, old or new, never none.

Each build writes into bundles/.staging/<pid>-<random>/ and publishes with one atomic exchange
(renameat2(RENAME_EXCHANGE) on Linux, renamex_np(RENAME_SWAP) on macOS) or, for a new bundle, one
rename. A file lock on the target keeps two builds of the same bundle from racing; leftovers of
killed builds are removed by the next build (their process is gone).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from pipeline.format.bundle_folder import (
    CACHE_FILE,
    MANIFEST_FILE,
    REPORT_FILE,
    STAGING_DIR,
    SUMS_FILE,
    sums_text,
)
from pipeline.format.errors import BuildError
from pipeline.format.fingerprint import FileDigests, file_digests, sha256_bytes
from pipeline.format.manifest import Manifest, manifest_bytes

LOCKS_DIR = "locks"


def staging_root(bundles_root: Path) -> Path:
    return Path(bundles_root) / STAGING_DIR


def target_lock(bundles_root: Path, dest: Path) -> Any:
    """An exclusive, non-waiting file lock on one bundle path (released when the process dies)."""
    from filelock import FileLock

    rel = Path(dest).relative_to(bundles_root)
    folder = staging_root(bundles_root) / LOCKS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    return FileLock(str(folder / ("__".join(rel.parts) + ".lock")), timeout=0)


def new_staging_folder(bundles_root: Path) -> Path:
    """A fresh folder to write a bundle into, named after this process so cleanup can tell."""
    root = staging_root(bundles_root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; deployed bundles must be readable
    return tmp


def write_cache(
    tmp: Path, cache: list[Any], tokens: list[int], metadata: dict[str, str]
) -> FileDigests:
    """cache.safetensors (mlx-lm's layout, the token ids in its metadata), and its digests."""
    from mlx_lm.models.cache import save_prompt_cache

    user = {**metadata, "token_ids": json.dumps(tokens, separators=(",", ":"))}
    save_prompt_cache(str(tmp / CACHE_FILE), cache, user)
    return file_digests(tmp / CACHE_FILE)


def write_manifest(
    tmp: Path, manifest: Manifest, cache_digests: FileDigests, report: dict[str, Any]
) -> None:
    """manifest.json, SHA256SUMS over it and the cache file, build-report.json; all synced."""
    data = manifest_bytes(manifest)
    (tmp / MANIFEST_FILE).write_bytes(data)
    digests = {CACHE_FILE: cache_digests.sha256, MANIFEST_FILE: sha256_bytes(data)}
    (tmp / SUMS_FILE).write_text(sums_text(digests))
    (tmp / REPORT_FILE).write_text(json.dumps(report, sort_keys=True, indent=2) + "\n")
    _fsync_folder(tmp)


def publish(tmp: Path, dest: Path) -> None:
    """Move the staged bundle to dest atomically; an older bundle there is swapped out, then removed."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists() or dest.is_symlink():
        if not _exchange(tmp, dest):
            _replace_with_gap(tmp, dest)
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old bundle
    else:
        try:
            os.rename(tmp, dest)
        except OSError as exc:  # another writer published first (no lock, e.g. other host)
            raise BuildError(
                f"cannot publish {dest}: another build created it meanwhile ({exc.strerror}); "
                "the other build's bundle was left in place"
            ) from None
    _fsync_path(dest.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths; False where the platform or filesystem cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    src, dst = os.fsencode(a), os.fsencode(b)
    if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
        at_fdcwd, rename_exchange = -100, 2
        return libc.renameat2(at_fdcwd, src, at_fdcwd, dst, rename_exchange) == 0
    if sys.platform == "darwin" and hasattr(libc, "renamex_np"):
        return libc.renamex_np(src, dst, 0x2) == 0  # RENAME_SWAP
    return False


def _replace_with_gap(tmp: Path, dest: Path) -> None:
    """Fallback without an exchange call: two renames (a brief moment with no bundle at dest)."""
    old = tmp.with_name(tmp.name + ".old")
    os.rename(dest, old)
    os.rename(tmp, dest)
    os.rename(old, tmp)  # so the caller's cleanup of tmp removes the old bundle


def abandoned_staging(bundles_root: Path) -> list[Path]:
    """Staging entries ("<pid>-...") whose process is gone on this host, never the locks folder."""
    root = staging_root(bundles_root)
    if not root.is_dir():
        return []
    return [tmp for tmp in sorted(root.iterdir()) if is_abandoned(tmp)]


def is_abandoned(tmp: Path) -> bool:
    pid = tmp.name.split("-", 1)[0]
    return tmp.name != LOCKS_DIR and pid.isdigit() and not _alive(int(pid))


def clean_staging(bundles_root: Path) -> list[Path]:
    """Remove staging folders of builds whose process is gone; return what was removed."""
    removed = abandoned_staging(bundles_root)
    for tmp in removed:
        shutil.rmtree(tmp, ignore_errors=True)
    return removed


def free_bytes(bundles_root: Path) -> int:
    """Free space for an unprivileged writer on the filesystem holding the bundles folder."""
    path = Path(bundles_root).absolute()
    while not path.exists():
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_folder(folder: Path) -> None:
    for path in folder.iterdir():
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
    _fsync_path(folder)


def _fsync_path(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
