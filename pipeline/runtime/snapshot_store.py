"""Runtime snapshots on disk (`serve --snapshots DIR`): one serve per folder (a file lock), sets
written whole or not at all, read back through the one validator with the host key.

DIR/
  .lock                       flock held by the serve process using DIR
  set-<N>/<rank>-<id16>/      the current set: one snapshot per folder, in the bundle format
                              (cache.safetensors, manifest.json of kind "snapshot", SHA256SUMS,
                              manifest.json.minisig by the host key)
  .staging-<pid>-<ns>/        a set being written; renamed to set-<N+1> once complete

A set appears by one rename; older sets and staging leftovers (a crash, a stop cut short) are
removed at the next start or save, so a half-written set is never read. Serve reads and removes
only what it wrote: a set or staging folder holds SET_MARK, written first; anything else in DIR
(an operator's own `set-2/`) is left as it is, with a warning. DIR is opened once, at the start,
after its checks, and held: every later step works under that open folder, and a save first checks
that DIR still is it (one removed, or replaced by a link to a public folder, is not written).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import platform
import re
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import __version__
from pipeline.format.bundle_writer import write_bundle_files, write_cache_file
from pipeline.format.errors import BundleError, PipelineError
from pipeline.format.fingerprint import ModelIdentity, canonical_json, sha256_bytes
from pipeline.format.manifest import (
    SNAPSHOT_FORMAT,
    BuilderInfo,
    CacheInfo,
    FidelityInfo,
    Manifest,
    ModelInfo,
    SnapshotInfo,
    SourceInfo,
    TokenInfo,
)
from pipeline.format.regular_files import FileProblem
from pipeline.format.safe_files import (
    PRIVATE_FOLDER,
    LockHeld,
    lock_at,
    not_private,
    read_at,
    take_lock,
    write_new,
)
from pipeline.format.safe_tree import is_empty_at, open_folder_at, remove_at
from pipeline.format.validate import Validated, validate
from pipeline.runtime.prompt_cache import fork_cache

LOCK_FILE = ".lock"
SET_NAME = re.compile(r"^set-([1-9][0-9]{0,8})\Z")
MAX_SET = 999_999_999  # the highest number SET_NAME matches
STAGING_NAME = re.compile(r"^\.staging-[0-9]+-[0-9]+\Z")
SET_MARK = ".snapshot-set"  # in every set and staging folder serve writes (its first file)
MARK_TEXT = b"a set of runtime snapshots written by serve --snapshots (prefix-bundles)\n"


@dataclass(frozen=True)
class Entry:
    """One prompt-cache entry to save: what a server hook lists, hottest first."""

    tokens: list[int]  # exactly the tokens the cache holds
    cache: list[Any]
    source: str  # how it was produced, e.g. "mlx_lm.server prompt cache (assistant)"
    lossy: bool  # continues quantized KV (recorded on the snapshot, never recomputed)
    continued_from: str | None = None  # NAME@VERSION of a bundle covering its opening
    # the bundles its K/V may continue (None: Snapshots works them out when it saves)
    depends_on: tuple[SourceInfo, ...] | None = None


@dataclass(frozen=True)
class Context:
    """What every snapshot of one serve process records: server, model and library identity."""

    server: str  # manifest ServerName ("mlx-lm")
    identity: ModelIdentity
    slug: str
    template_source: str


class SnapshotFolder:
    """DIR, private, held open and locked by this process for as long as it lives. `create`: a
    missing DIR is made (serve); `listing`: only read (prune's dry run), no lock file is made."""

    def __init__(
        self, root: Path, create: bool = True, listing: bool = False, held: int | None = None
    ) -> None:
        """`held`: DIR's lock as the process that spawned this one took it (an inherited fd)."""
        self.root = Path(root)
        self._fd = open_private(self.root, create=create and not listing)
        try:
            if held is not None:
                self._lock = adopt_lock(self.root, held, self._fd)
                return
            self._lock = lock_folder(self.root, create=not listing, dir_fd=self._fd)
        except BaseException:
            os.close(self._fd)
            raise

    @property
    def lock_fd(self) -> int:
        """The open file holding DIR's lock (what a spawned model process inherits)."""
        return self._lock

    def close(self) -> None:
        """Release the folder (the process's exit does it too)."""
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def check(self) -> None:
        """PipelineError unless DIR still is the folder opened at the start, owner-only: one
        removed, moved or replaced (by a link to a public folder) while serve ran is not written."""
        held = os.fstat(self._fd)
        try:
            now = os.stat(self.root)
        except OSError:
            now = None
        if now is None and (held.st_nlink == 0 or not os.path.lexists(self.root)):
            raise PipelineError(
                f"snapshots: {self.root} is gone (removed or moved while serve ran); nothing "
                "saved; restart serve to save there again (it creates a missing folder)"
            )
        if now is None or not os.path.samestat(now, held) or held.st_nlink == 0:
            raise PipelineError(
                f"snapshots: {self.root} is no longer the folder serve started with "
                f"({_replaced_by(self.root)}); not saved; restart serve to use what is there now "
                "(its checks run at the start)"
            )
        if not_private(held, want_dir=True) is not None:
            raise PipelineError(
                f"snapshots: {self.root} is now open to other users (mode "
                f"{stat.S_IMODE(held.st_mode):04o}, uid {held.st_uid}); not saved: snapshots hold "
                "client prompts; make it yours with mode 0700 again"
            )

    def scan(self) -> tuple[list[tuple[int, Path]], list[Path], list[tuple[Path, str]]]:
        """(the sets, newest first; staging leftovers; what is neither, with why). A set or a
        staging folder is a real folder (a link is never followed) of a name serve writes, with
        serve's mark in it (a staging folder may lack it: a crash right after its mkdir)."""
        sets, staging, strays = [], [], []
        for entry in sorted(os.scandir(self._fd), key=lambda e: e.name):
            path, folder = self.root / entry.name, entry.is_dir(follow_symlinks=False)
            if entry.name == LOCK_FILE:
                continue
            set_name, staged = SET_NAME.match(entry.name), STAGING_NAME.match(entry.name)
            marked = folder and is_marked(Path(entry.name), dir_fd=self._fd)
            if set_name and marked:
                sets.append((int(set_name[1]), path))
            elif folder and staged and (marked or is_empty_at(self._fd, entry.name)):
                staging.append(path)
            else:
                strays.append((path, _stray(entry, folder)))
        return sorted(sets, reverse=True), staging, strays

    def sets(self) -> list[tuple[int, Path]]:
        """The sets in the folder, newest first."""
        return self.scan()[0]

    def strays(self) -> list[str]:
        """One line for each entry that is neither a set nor staging (left as it is)."""
        return [f"{shown(path)} {why}; skipped (left as it is)" for path, why in self.scan()[2]]

    def tidy(self) -> None:
        """Remove staging leftovers (a crash mid-save; this process holds the lock)."""
        for path in self.scan()[1]:
            with contextlib.suppress(OSError):
                remove_at(self._fd, path.name)

    def drop_sets(self, keep: Path, older_only: bool = False, spare: tuple[Path, ...] = ()) -> None:
        """Remove every set but `keep` and `spare` (`older_only`: those numbered below keep)."""
        number = int(SET_NAME.match(keep.name)[1])
        for n, path in self.sets():
            if path != keep and path not in spare and (n < number or not older_only):
                with contextlib.suppress(OSError):
                    remove_at(self._fd, path.name)

    def wipe(self) -> list[Path]:
        """Remove every set and staging leftover (this process holds the lock: no serve uses the
        folder); return what was removed. Anything else is left as it is."""
        sets, staging, _ = self.scan()
        gone = [path for _, path in sets] + staging
        for path in gone:
            remove_at(self._fd, path.name)
        return gone

    def write_set(
        self, entries: Sequence[Entry], context: Context, key: Any, spare: tuple[Path, ...] = ()
    ) -> Path:
        """Write `entries` (hottest first) as the new set, signed with `key`; the previous set
        stays until the new one is complete, then every other set but `spare` is removed (the sets
        found when none mounted at this start: another model's). A failed write
        (a full disk) is a PipelineError and leaves the folder as it was; so is a DIR that is no
        longer the folder opened at the start (`check`): nothing is written then."""
        self.check()
        sets = self.sets()
        try:
            final = self._publish(entries, context, key, _free_name(self.root, sets, self._fd))
        except (OSError, RuntimeError) as exc:  # mlx's writer raises RuntimeError when full
            kept = f"the previous set {sets[0][1]} stays" if sets else "no set was saved before"
            raise PipelineError(
                f"snapshots: the new set was not saved under {self.root} ({type(exc).__name__}: "
                f"{exc}: the disk is full or cannot be written); {kept}; free space there or "
                "lower --snapshot-budget"
            ) from None
        self.drop_sets(final, spare=spare)
        return final

    def _publish(self, entries: Sequence[Entry], context: Context, key: Any, final: Path) -> Path:
        """The set made under the held folder and renamed there; the snapshots' files are
        written through the staging folder's path once it is shown to reach the folder made."""
        name = f".staging-{os.getpid()}-{time.monotonic_ns()}"
        os.mkdir(name, PRIVATE_FOLDER, dir_fd=self._fd)
        try:
            fd = open_folder_at(self._fd, name)
            try:
                self._reaches(self.root / name, fd)
                write_new(SET_MARK, MARK_TEXT, dir_fd=fd)
                for rank, entry in enumerate(entries):
                    write_snapshot(self.root / name, rank, entry, context, key)
                os.fsync(fd)
                self._reaches(self.root / name, fd)  # a rename through DIR's path publishes it
            finally:
                os.close(fd)
            os.rename(self.root / name, final)
        except BaseException:  # a full disk, a stop cut short: the previous set stays alone
            with contextlib.suppress(OSError):
                remove_at(self._fd, name)
            raise
        with contextlib.suppress(OSError):  # the set is in place; only its durability is unsure
            os.fsync(self._fd)
        return final

    def _reaches(self, path: Path, fd: int) -> None:
        """PipelineError unless `path` is the folder `fd` holds (DIR replaced since `check`)."""
        try:
            same = os.path.samestat(os.stat(path, follow_symlinks=False), os.fstat(fd))
        except OSError:
            same = False
        if not same:
            raise PipelineError(
                f"snapshots: {self.root} is no longer the folder serve started with (it was "
                "replaced during the save); not saved; restart serve to use what is there now"
            )


def _replaced_by(root: Path) -> str:
    """What DIR is now, for the line refusing a save into it."""
    if os.path.islink(root):
        return f"it is now a symbolic link to {shown(os.readlink(root))}"
    if not os.path.isdir(root):
        return "it is now something other than a folder"
    return "another folder is there now"


def _stray(entry: os.DirEntry, folder: bool) -> str:
    if entry.is_symlink():
        return "is a symbolic link (never followed)"
    if not folder:
        return "is not a folder"
    if SET_NAME.match(entry.name) or STAGING_NAME.match(entry.name):
        return f"was not written by serve (it has no {SET_MARK})"
    if entry.name.startswith("set-"):
        return f"is not a set name (set-1 to set-{MAX_SET})"
    return "is not a snapshot set"


def is_marked(folder: Path, dir_fd: int | None = None) -> bool:
    """The folder (under `dir_fd` if given) holds serve's mark: a regular file of exactly
    MARK_TEXT (never a link)."""
    return read_at(dir_fd, folder / SET_MARK, 256) == MARK_TEXT


def shown(path: Path | str) -> str:
    """A path as one log line may show it: control characters (a newline in a name someone
    chose) escaped, so that one line stays one line."""
    text = str(path)
    return text if text.isprintable() else repr(text)[1:-1]


def _free_name(root: Path, sets: list[tuple[int, Path]], dir_fd: int) -> Path:
    """set-<N+1> after the newest set, or the first free name in SET_NAME's range after it."""
    first = sets[0][0] + 1 if sets else 1
    for n in itertools.chain(range(first, MAX_SET + 1), range(1, first)):
        try:
            os.stat(f"set-{n}", dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return root / f"set-{n}"
    raise PipelineError(f"--snapshots {root}: no free set name; empty the folder")


def private_folder(root: Path, create: bool) -> None:
    """DIR as serve may use it: one it creates (0700), or an existing folder of this user that
    no one else can read. It is never chmod-ed: it may be shared (a link to /tmp)."""
    os.close(open_private(Path(root), create))


def open_private(root: Path, create: bool) -> int:
    """DIR opened (a link to a folder is followed once, here) and checked as `private_folder`
    says, through the open folder itself: what is checked is what is held."""
    if create and not os.path.lexists(root):
        root.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(root, PRIVATE_FOLDER)
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise PipelineError(f"--snapshots {root}: no such folder; pass serve's DIR") from None
    except OSError:  # not a folder, or one this user cannot read: say which
        _check_private(root, os.stat(root))
        raise PipelineError(_unusable(root)) from None
    try:
        _check_private(root, os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unusable(root: Path) -> str:
    return (
        f"--snapshots {root}: this user cannot read and write the folder (mode "
        f"{stat.S_IMODE(os.stat(root).st_mode):04o}); give it mode 0700 or pass another folder"
    )


def _check_private(root: Path, st: os.stat_result) -> None:
    why = not_private(st, want_dir=True)
    if why == "kind":
        raise PipelineError(
            f"--snapshots {root} is not a folder; pass a folder (serve creates a missing one)"
        )
    if why == "owner":
        raise PipelineError(
            f"--snapshots {root} belongs to uid {st.st_uid}, not this user; snapshots hold "
            "client prompts: pass a folder of your own that only you can read (serve creates "
            "a missing one with mode 0700)"
        )
    if why == "mode":
        raise PipelineError(
            f"--snapshots {root} is open to other users (mode {stat.S_IMODE(st.st_mode):04o}); "
            "snapshots hold client prompts: pass a folder of your own that only you can read "
            "(serve creates a missing one with mode 0700)"
        )


def lock_folder(root: Path, create: bool, dir_fd: int | None = None) -> int:
    """DIR's lock (in the folder `dir_fd` holds, if given), held until closed (-1: a listing of
    a folder no serve has used)."""
    if not os.access(root, os.R_OK | os.W_OK | os.X_OK):
        raise PipelineError(_unusable(root))
    try:
        fd = lock_at(dir_fd, LOCK_FILE if dir_fd is not None else root / LOCK_FILE, create)
    except FileProblem:
        raise PipelineError(
            f"--snapshots {root}: {LOCK_FILE} is not a regular file; remove it (serve makes it)"
        ) from None
    except LockHeld:
        raise PipelineError(
            f"--snapshots {root} is in use by another serve process (it holds "
            f"{root / LOCK_FILE}); give each serve its own snapshot folder"
        ) from None
    except OSError as exc:
        raise PipelineError(
            f"--snapshots {root}: {LOCK_FILE} cannot be opened ({exc.strerror}); remove it"
        ) from None
    return -1 if fd is None else fd


def adopt_lock(root: Path, fd: int, dir_fd: int) -> int:
    """The lock the spawning serve took on DIR, inherited as `fd`: it must still be DIR/.lock
    (the folder opened here) and held by this open file (taking it again is then a no-op)."""
    try:
        same = os.path.samestat(
            os.fstat(fd), os.stat(LOCK_FILE, dir_fd=dir_fd, follow_symlinks=False)
        )
        take_lock(fd)
    except (OSError, LockHeld):
        same = False
    if not same:
        raise PipelineError(
            f"--snapshots {root}: the lock serve took on {root / LOCK_FILE} is not held by this "
            "model process (the folder changed after serve checked it); restart serve"
        )
    return fd


def write_snapshot(parent: Path, rank: int, entry: Entry, context: Context, key: Any) -> Path:
    """One snapshot folder in the bundle format (the one bundle writer), signed, owner-only."""
    ids_sha256 = sha256_bytes(canonical_json(entry.tokens))
    ident = context.identity
    snapshot_id = sha256_bytes(canonical_json([ident.model, ident.template, ids_sha256]))
    folder = parent / f"{rank:02d}-{snapshot_id[:16]}"
    folder.mkdir(mode=PRIVATE_FOLDER)
    metadata = {"model": context.slug, "tokenizer_config": "{}"}
    # a KVCache's buffer runs past its offset: save new handles cut to it (nothing is copied)
    cut = fork_cache(list(entry.cache))
    digests, layout = write_cache_file(folder, cut, entry.tokens, metadata)
    manifest = snapshot_manifest(rank, entry, context, snapshot_id, digests, layout)
    write_bundle_files(folder, manifest, digests, key=key, private=True)
    return folder


def snapshot_manifest(
    rank: int, entry: Entry, context: Context, snapshot_id: str, digests: Any, layout: str
) -> Manifest:
    """The manifest of one snapshot: kind "snapshot", the identity and library it is valid for."""
    import mlx.core as mx

    from pipeline.format.compat import installed_mlx_lm

    ident, kv = context.identity, cache_facts(entry.cache)
    count = len(entry.tokens)
    return Manifest(
        format_version=SNAPSHOT_FORMAT,
        kind="snapshot",
        tokens=TokenInfo(
            count=count,
            ids_sha256=sha256_bytes(canonical_json(entry.tokens)),
            rendered_tokens=count,
            stable_tokens=count,
        ),
        model=ModelInfo(
            slug=context.slug,
            fingerprint=ident.model,
            tokenizer_fingerprint=ident.tokenizer,
            template_sha256=ident.template,
            template_source=context.template_source,
        ),
        cache=CacheInfo(
            classes=kv["classes"],
            dtype=kv["dtype"],
            kv_bits=kv["bits"],
            kv_group_size=kv["group_size"],
            prefill_step_size=2048,  # not used for the KV classes a snapshot may hold
            nbytes=kv["nbytes"],
            file_sha256=digests.sha256,
            file_blake3=digests.blake3,
            file_bytes=digests.size,
            layout=layout,
        ),
        builder=BuilderInfo(
            pipeline=__version__,
            mlx=mx.__version__,
            mlx_lm=installed_mlx_lm(),
            platform=f"{platform.system()} {platform.machine()} python{platform.python_version()}",
            device=str(mx.default_device()),
            compute_dtype=kv["dtype"],
            kernels=f"serve {context.server}: the server's own prefill",
        ),
        fidelity=FidelityInfo(checked=False),
        build_key=snapshot_id,
        snapshot=SnapshotInfo(
            server=context.server,
            source=entry.source,
            lossy=entry.lossy or kv["bits"] is not None,  # quantized KV is lossy, always
            continued_from=entry.continued_from,
            rank=rank,
            depends_on=list(entry.depends_on or ()),
        ),
    )


SAVED_CLASSES = ("KVCache", "QuantizedKVCache")


def cache_facts(cache: Sequence[Any]) -> dict[str, Any]:
    """Classes, KV dtype, quantization and array bytes of a cache of KVCache/QuantizedKVCache
    layers (PipelineError for another kind: their file form depends on how they were filled)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    classes = [type(layer).__name__ for layer in cache]
    if not set(classes) <= set(SAVED_CLASSES):
        raise PipelineError(
            f"a prompt-cache entry with {sorted(set(classes) - set(SAVED_CLASSES))} layers is "
            "not saved as a snapshot (only KVCache and QuantizedKVCache are, so far)"
        )
    state = [layer.state for layer in fork_cache(list(cache))]  # KV buffers cut to the offset
    arrays = [a for _, a in tree_flatten(state) if isinstance(a, mx.array)]
    quantized = [layer for layer in cache if hasattr(layer, "bits")]
    floats = [a for a in arrays if "float" in str(a.dtype)]
    return {
        "classes": classes,
        "dtype": str(floats[0].dtype).removeprefix("mlx.core."),
        "bits": quantized[0].bits if quantized else None,
        "group_size": quantized[0].group_size if quantized else 64,
        "nbytes": sum(a.nbytes for a in arrays),
    }


def read_heads(
    folder: Path, identity: ModelIdentity, public_key: Any
) -> tuple[list[Validated], list[BundleError]]:
    """Every snapshot of a set through the one validator up to its manifest (signed by the host
    key only, of this model and mlx-lm; no tensor read); the refused ones with their reasons."""
    mounted, refused = [], []
    try:
        paths = sorted(p for p in folder.iterdir() if p.name != SET_MARK)
    except OSError as exc:
        return [], [BundleError(shown(folder), f"cannot be read ({exc.strerror or exc})")]
    for path in paths:
        if path.is_symlink():  # nothing is read through a link out of DIR
            refused.append(BundleError(str(path), "a symbolic link (never followed)"))
            continue
        try:
            keys = (public_key,)
            mounted.append(
                validate(path, identity, trusted_keys=keys, kind="snapshot", manifest_only=True)
            )
        except BundleError as exc:
            refused.append(exc)
    return mounted, refused


def load_head(head: Validated, identity: ModelIdentity, public_key: Any) -> Validated:
    """A snapshot `read_heads` read, validated in full and loaded; BundleError if it changed
    since (its manifest is not the one read) or fails any check."""
    keys = (public_key,)
    full = validate(head.path, identity, load=True, trusted_keys=keys, kind="snapshot")
    if full.manifest_sha256 != head.manifest_sha256:
        raise BundleError(str(head.path), "its manifest.json changed while serve read it")
    return full


__all__ = [
    "Context",
    "Entry",
    "SnapshotFolder",
    "cache_facts",
    "load_head",
    "read_heads",
    "shown",
    "write_snapshot",
]
