"""Write a bundle so that its final path always names a complete bundle, old or new, never none.

Each build writes into bundles/.staging/<pid>-<random>/ and publishes with one atomic exchange
(renameat2(RENAME_EXCHANGE) on Linux, renameatx_np(RENAME_SWAP) on macOS) or, for a new bundle, one
rename. Every create, rename and delete goes through the safe tree (pipeline.format.safe_tree): no link below the bundles root
is followed, nothing outside it is touched. A file lock on the target keeps two builds of the same bundle from racing; leftovers of
killed builds are removed by the next build (their process is gone).
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path
from typing import Any

from pipeline.builder.readback import read_back, saved_arrays
from pipeline.format.bundle_folder import STAGING_DIR
from pipeline.format.bundle_writer import write_cache_file
from pipeline.format.errors import BuildError, PipelineError
from pipeline.format.fingerprint import FileDigests, sha256_bytes
from pipeline.format.names import parse_index
from pipeline.format.safe_files import sync_path
from pipeline.format.safe_tree import (
    entries,
    exchange,
    folder_fd,
    inside,
    is_link_or_missing,
    make_folders,
    remove_tree,
    rename,
)

LOCKS_DIR = "locks"


def staging_root(bundles_root: Path) -> Path:
    return Path(bundles_root) / STAGING_DIR


def target_lock(bundles_root: Path, dest: Path) -> Any:
    """An exclusive, non-waiting file lock on one bundle path (released when the process dies)."""
    from filelock import FileLock

    rel = inside(bundles_root, dest)
    folder = staging_root(bundles_root) / LOCKS_DIR
    make_folders(bundles_root, folder)  # a linked .staging is refused, not followed
    return FileLock(str(folder / ("__".join(rel) + ".lock")), timeout=0)


def host_tag() -> str:
    """This host (and pid namespace) in a staging name: a build sweeps only its own host's dead
    builds, never those of another machine or container sharing the bundles folder, whose pids
    it cannot see."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:  # not Linux: the host name alone
        namespace = ""
    return sha256_bytes(f"{socket.gethostname()}|{namespace}".encode())[:12]


def new_staging_folder(bundles_root: Path) -> Path:
    """A fresh folder to write a bundle into, named after this process and host so that cleanup
    can tell ("<pid>-<random>.<host tag>")."""
    root = staging_root(bundles_root)
    with folder_fd(bundles_root, (STAGING_DIR,), create=True) as fd:
        while True:
            name = f"{os.getpid()}-{secrets.token_hex(4)}.{host_tag()}"
            try:  # deployed bundles must be readable: the umask decides, as for any folder
                os.mkdir(name, 0o777, dir_fd=fd)
                return root / name
            except FileExistsError:
                continue


def write_cache(
    tmp: Path, cache: list[Any], tokens: list[int], metadata: dict[str, str]
) -> FileDigests:
    """cache.safetensors (the one bundle writer) and its digests, from one read back that also
    proves every tensor holds `cache`'s bytes (BuildError if not). The manifest records the
    layout (cache.layout, from builder.mlx_lm)."""
    # read back from disk once: what was written, hashed and compared; the memo keys the digest
    # by the stat of what was read, so the self-check may trust it (a later change re-hashes)
    read = lambda path: read_back(path, saved_arrays(cache))  # noqa: E731
    return write_cache_file(tmp, cache, tokens, metadata, read)[0]


def publish(bundles_root: Path, tmp: Path, dest: Path) -> None:
    """Move the staged bundle to dest atomically; an older bundle there is swapped out, then removed."""
    if place(bundles_root, tmp, dest):
        discard(bundles_root, tmp)  # tmp now holds the old bundle


def place(bundles_root: Path, tmp: Path, dest: Path) -> bool:
    """Put the staged folder at dest (a link on the way or at dest is refused); True when an
    older bundle was there and now sits at tmp (`unplace` undoes this)."""
    root = Path(bundles_root)
    make_folders(root, dest.parent)
    there = is_link_or_missing(root, dest)
    if there:
        raise BuildError(
            f"cannot publish {dest}: it is a symlink; a bundle path is never replaced through a "
            "link: remove the link and build or pull again"
        )
    if there is not None:
        if not exchange(root, tmp, dest):
            _replace_with_gap(root, tmp, dest)
    else:
        try:
            rename(root, tmp, dest)
        except OSError as exc:  # another writer published first (no lock, e.g. other host)
            raise BuildError(
                f"cannot publish {dest}: another build created it meanwhile ({exc.strerror}); "
                "the other build's bundle was left in place"
            ) from None
    sync_path(dest.parent)
    return there is not None


def unplace(bundles_root: Path, tmp: Path, dest: Path, replaced: bool) -> None:
    """Undo `place`: the older bundle back at dest (or none), the staged one back at tmp."""
    if not (replaced and exchange(bundles_root, tmp, dest)):
        if replaced:
            _replace_with_gap(bundles_root, tmp, dest)
        else:
            rename(bundles_root, dest, tmp)
    sync_path(dest.parent)


def _replace_with_gap(root: Path, tmp: Path, dest: Path) -> None:
    """Fallback without an exchange call: three renames (a brief moment with no bundle at dest)."""
    old = tmp.with_name(tmp.name + ".old")
    rename(root, dest, old)
    rename(root, tmp, dest)
    rename(root, old, tmp)  # so the caller's cleanup of tmp removes the old bundle


def discard(bundles_root: Path, tmp: Path) -> None:
    """Remove a staging folder if it is still there (best effort: a later build removes it)."""
    try:
        remove_tree(bundles_root, tmp)
    except (OSError, PipelineError):
        pass


def abandoned_staging(bundles_root: Path) -> list[Path]:
    """Staging entries ("<pid>-...") whose process is gone on this host, never the locks folder.

    PipelineError when .staging is a link (its target is never listed or cleaned)."""
    root = staging_root(bundles_root)
    if not Path(bundles_root).is_dir() or is_link_or_missing(bundles_root, root) is None:
        return []
    return [root / name for name in entries(bundles_root, root) if is_abandoned(root / name)]


def is_abandoned(tmp: Path) -> bool:
    """A staging folder of a build on this host whose process is gone (a name without a host
    tag is from a release before tags, on whatever host: judged by its pid, as then)."""
    pid, _, rest = tmp.name.partition("-")
    _, dot, host = rest.partition(".")
    if tmp.name == LOCKS_DIR or (dot and host != host_tag()):
        return False
    return (number := parse_index(pid)) is not None and not _alive(number)


def clean_staging(bundles_root: Path) -> list[Path]:
    """Remove staging folders of builds whose process is gone; return what was removed."""
    removed = abandoned_staging(bundles_root)
    for tmp in removed:
        discard(bundles_root, tmp)
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
