"""What a server learned survives its restart or crash (`serve --snapshots DIR`): its hottest
prompt-cache entries spilled while it serves (snapshot_spill) and saved at a graceful stop, mounted
at the next start through the one validator.

A hook lists its server's entries (`Entry`, with a recency stamp from `Snapshots.tick`), says
`Snapshots.changed` after it stored one, and asks `Snapshots.fetch` inside its lookup; this module chooses what fits the byte budget, writes and
signs it (pipeline.runtime.snapshot_store), and holds restored snapshots on a shelf that answers
under the one reuse rule (`reusable_tokens`, `preference`) with the lossiness each snapshot
recorded. A restored snapshot is never written (requests get copy-on-write copies), and serves a
request only when it covers more than every pinned bundle: it never beats an exact bundle.
"""

from __future__ import annotations

import itertools
import logging
import re
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.format.errors import PipelineError
from pipeline.format.manifest import SourceInfo
from pipeline.format.names import is_name
from pipeline.runtime.mount import identity_for
from pipeline.runtime.prompt_cache import (
    fork_cache,
    lossy_min_tokens,
    preference,
    reusable_tokens,
)
from pipeline.runtime.snapshot_key import host_key
from pipeline.runtime.snapshot_restore import UNTRUSTED, choose_and_load
from pipeline.runtime.snapshot_spill import Listed, Spiller, resolved
from pipeline.runtime.snapshot_store import (
    Context,
    Entry,
    SnapshotFolder,
    cache_facts,
    read_heads,
    shown,
)

log = logging.getLogger("prefix-bundles")
DEFAULT_BUDGET = 2 << 30  # bytes of KV written at a stop (and restored at the next start)


@dataclass
class _Shelved:
    """A restored snapshot: its arrays are never written, only re-wrapped for a request."""

    name: str
    tokens: np.ndarray
    cache: list
    trimmable: bool
    lossy: bool  # as the snapshot recorded it
    nbytes: int
    stamp: int
    depends_on: tuple[SourceInfo, ...] = ()  # the bundles it may continue, as it recorded them
    taken: bool = False  # handed to a request: the server's entries may descend from it since
    untrusted: bool = False  # one it continues is not mounted now: never served or saved again


@dataclass
class SaveReport:
    saved: int = 0
    tokens: int = 0
    nbytes: int = 0
    skipped: dict[str, int] = field(default_factory=dict)


class Snapshots:
    """serve's snapshots for one process and one served model: the locked folder, the host key,
    the shelf of restored snapshots and the recency clock the hook stamps its entries with."""

    def __init__(
        self,
        root: Path,
        budget: int,
        model_dir: Path,
        chat_template: str | None,
        server: str,
        held: int | None = None,
    ) -> None:
        # refuses a second serve on the same folder; `held`: the lock the spawning serve took
        self.folder = SnapshotFolder(root, held=held)
        self.budget = budget
        self.key = host_key()
        identity = identity_for(Path(model_dir), chat_template)
        if identity.template is None:
            raise PipelineError(
                f"--snapshots: the model {model_dir} has no chat template and none was given; "
                "a snapshot records the template it is valid for: pass --chat-template"
            )
        slug = re.sub(r"[^a-z0-9._-]+", "-", Path(model_dir).resolve().name.lower()).strip("-._")
        source = "model" if chat_template is None else "serve --chat-template"
        self.context = Context(
            server, identity, slug[:64] if is_name(slug[:64]) else "model", source
        )
        self._shelf: list[_Shelved] = []
        self._clock = itertools.count(1)
        self._lock = threading.Lock()
        self._saving = threading.Lock()  # one save at a time: a spill, the stop's
        self.spiller: Spiller | None = None  # spills while serving (`spill_while_serving`)
        self._stopped = False  # the stop's save has begun: no spill after it
        # the bundles mounted now (`trust`), and every one mounted at any time in this process
        # (digest: (name, tokens)): an entry sharing its opening with one may continue it
        self._bundles: Callable[[], Sequence[Any]] = lambda: ()
        self._seen: dict[str, tuple[str, np.ndarray]] = {}
        # every set there when none of them mounted here (another model's, another mlx-lm's,
        # another host's): a save keeps them beside its own, so one start with the wrong model
        # costs no good set (the next start that mounts one removes the others at its save)
        self.spare: tuple[Path, ...] = ()

    def close(self) -> None:
        """Release the snapshot folder for another process (exiting does it too)."""
        self.folder.close()

    def tick(self) -> int:
        """A recency stamp: larger is more recent (the hook stamps each entry it stores)."""
        return self._next()

    def _next(self) -> int:
        with self._lock:
            return next(self._clock)

    def spill_while_serving(
        self,
        every: float,
        listing: Callable[[], Sequence[Listed]],
        covered: Callable[[list[int]], int],
        start: bool = True,
    ) -> Spiller:
        """From now on the server's entries (`listing()`, on the thread that owns its cache, at
        each `changed`) are spilled to DIR by a thread of their own (snapshot_spill), at most
        every `every` seconds; `covered`: what bundles hold. `start`: run that thread (tests step
        it with `spiller.spill()`)."""
        write = lambda entries, why: self._spill(entries, covered, why)  # noqa: E731
        self.spiller = Spiller(write, every, listing)
        if start:
            self.spiller.start()
        return self.spiller

    def changed(self) -> None:
        """The hook stored an entry (call it on the thread that owns the server's cache, after
        the entry's stamp is recorded): capture the entries for the next spill."""
        if self.spiller is not None and not self._stopped:
            self.spiller.capture()

    # --- startup -------------------------------------------------------------------------
    def trust(self, bundles: Callable[[], Sequence[Any]]) -> None:
        """`bundles()`: the bundles mounted and trusted now (a remount changes them); a learned
        entry continuing one is served and saved only while it is among them."""
        self._bundles = bundles
        self.trusted()

    def trusted(self) -> set[str]:
        """The manifest digests of the bundles mounted now (each one is remembered as seen)."""
        now = list(self._bundles())
        with self._lock:
            for b in now:
                self._seen.setdefault(b.manifest_sha256, (b.name, np.asarray(b.tokens)))
        return {b.manifest_sha256 for b in now}

    def sources(self, tokens: Sequence[int]) -> tuple[SourceInfo, ...]:
        """Every bundle an entry of `tokens` may continue: one mounted at any time in this
        process that shares its opening (a request may have taken any part of it), and those a
        restored snapshot sharing its opening continues (a chain)."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        self.trusted()
        with self._lock:
            seen, shelf = list(self._seen.items()), list(self._shelf)
        found = {d: n for d, (n, t) in seen if len(ids) and len(t) and t[0] == ids[0]}
        for s in shelf:
            if s.taken and len(ids) and s.tokens[0] == ids[0]:
                found.update((d.manifest_sha256, d.bundle) for d in s.depends_on)
        return tuple(SourceInfo(bundle=n, manifest_sha256=d) for d, n in sorted(found.items()))

    # --- startup -------------------------------------------------------------------------
    def restore(
        self,
        bundle_tokens: Sequence[Sequence[int]],
        unusable: Callable[[Any], str | None] = lambda snapshot: None,
    ) -> None:
        """Mount the newest set through the validator (host key trusted, nothing else), hottest
        first within the byte budget, reading each manifest before any tensor
        (snapshot_restore). Left out: a snapshot a mounted bundle or a hotter restored one holds
        whole, a copy, one the server's options could not use (`unusable`, the hook's rule for
        bundles: a refusal line), one continuing a bundle not mounted now, and what no longer
        fits the budget."""
        start = time.perf_counter()
        self.folder.tidy()
        for line in self.folder.strays():
            log.warning("snapshots: %s", line)
        held = [np.asarray(t, dtype=np.int64) for t in bundle_tokens]
        current, chosen, found = self._newest_that_mounts(held, unusable)
        if current is None:
            log.info(
                "snapshots: none in %s yet (they are written while serving and at a graceful stop)",
                self.folder.root,
            )
            return
        for v, ids in reversed(chosen.kept):  # coldest first: the hottest gets the newest stamp
            self._shelve(v, ids)
        left_out = ", ".join(f"{n} {why}" for why, n in sorted(chosen.left.items()))
        log.info(
            "snapshots: restored %d of %d from %s (%d tokens, %.1f MiB; budget %.1f MiB), "
            "%d refused%s, in %.1f ms",
            len(chosen.kept), found, current, sum(len(ids) for _, ids in chosen.kept),
            chosen.nbytes / 2**20, self.budget / 2**20, chosen.refused,
            f", left out: {left_out}" if left_out else "", (time.perf_counter() - start) * 1000,
        )  # fmt: skip

    def _newest_that_mounts(self, held: list, unusable: Callable[[Any], str | None]) -> tuple:
        """(set, what it restores, how many snapshots it holds): the newest set not every
        snapshot of which is refused (the older sets are removed), else the newest set, else
        None. A newer set whose snapshots are all refused (empty, another host's) is skipped with
        a warning, and removed only once a new set is saved."""
        sets, first = self.folder.sets(), None
        identity, public = self.context.identity, self.key.public_key()
        for i, (_, path) in enumerate(sets):
            heads, refused = read_heads(path, identity, public)
            for exc in refused:
                log.warning("refused snapshot %s: %s", shown(exc.bundle), shown(exc.reason))
            trusted = self.trusted()
            chosen = choose_and_load(
                heads, self.budget, list(held), unusable, trusted, (identity, public)
            )
            chosen.refused += len(refused)
            found = len(heads) + len(refused)
            if chosen.refused < found:
                self.spare = ()
                self.folder.drop_sets(path, older_only=True)
                return path, chosen, found
            first = first or (path, chosen, found)
            if i + 1 < len(sets):
                what = "snapshot" if found == 1 else "snapshots"
                log.warning(
                    "snapshots: %s; skipped, the older sets are tried",
                    f"none of the {found} {what} in {path} mounts"
                    if found
                    else f"{path} holds no snapshot",
                )
        # no set mounted here (another model's, mlx-lm's, host's): a save keeps them all
        self.spare = tuple(path for _, path in sets)
        return first or (None, None, 0)

    def _shelve(self, v: Any, ids: np.ndarray) -> _Shelved:
        cache = v.cache or []
        entry = _Shelved(
            v.path.name, ids, cache, all(layer.is_trimmable() for layer in cache),
            v.manifest.snapshot.lossy, v.manifest.cache.nbytes, self._next(),
            tuple(v.manifest.snapshot.depends_on or ()),
        )  # fmt: skip
        with self._lock:
            self._shelf.append(entry)
        return entry

    # --- requests ------------------------------------------------------------------------
    def fetch(self, tokens: Sequence[int], better_than: int) -> tuple[list | None, int, str]:
        """(cache, tokens it covers, name) from the best restored snapshot under the reuse rule,
        only when it covers more than `better_than` tokens (what the bundles or the server's own
        entries already cover); (None, 0, "") otherwise."""
        request = np.asarray(tokens, dtype=np.int64).reshape(-1)
        shelf = self._served()
        best, rank = None, (0, False, 0)
        for s in shelf:
            keep = reusable_tokens(s.tokens, request, s.trimmable, s.lossy)
            r = preference(keep, s.lossy, len(s.tokens))
            if keep > better_than and r > rank:
                best, rank = s, r
        if best is None:
            return None, 0, ""
        best.stamp, best.taken = self._next(), True
        return fork_cache(best.cache, len(best.tokens) - rank[0]), rank[0], best.name

    def covered(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of a request the best restored snapshot can serve (no copy)."""
        request = np.asarray(tokens, dtype=np.int64).reshape(-1)
        shelf = self._served()
        return max(
            (reusable_tokens(s.tokens, request, s.trimmable, s.lossy) for s in shelf), default=0
        )

    def _served(self) -> list[_Shelved]:
        """The restored snapshots that may serve now: one continuing a bundle a remount removed
        or replaced since is never served again (one line; its lossy rule still holds)."""
        trusted = self.trusted()
        with self._lock:
            shelf = [s for s in self._shelf if not s.untrusted]
            lost = [s for s in shelf if any(d.manifest_sha256 not in trusted for d in s.depends_on)]
            for s in lost:
                s.untrusted = True
        for s in lost:
            gone = next(d for d in s.depends_on if d.manifest_sha256 not in trusted)
            log.warning(
                "snapshots: snapshot %s is no longer served: it continues bundle %s, which is "
                "not mounted now", s.name, gone.bundle,
            )  # fmt: skip
        return [s for s in shelf if not s.untrusted]

    def __len__(self) -> int:
        """How many restored snapshots are held."""
        with self._lock:
            return len(self._shelf)

    def lossy_floor(self, tokens: Sequence[int]) -> int:
        """The fewest leading tokens a server entry sharing its opening with a lossy snapshot a
        request took must cover (it may descend from it; 0: no such snapshot: one no request
        took has no descendants, as PromptCacheManager.lossy_floor's bundles)."""
        request = np.asarray(tokens, dtype=np.int64).reshape(-1)
        with self._lock:
            lossy = [s for s in self._shelf if s.lossy and s.taken]
        floors = [
            lossy_min_tokens(len(s.tokens))
            for s in lossy
            if len(request) and s.tokens[0] == request[0]
        ]
        return max(floors, default=0)

    # --- shutdown ------------------------------------------------------------------------
    def stop_saving(self) -> None:
        """The server has stopped: wait for a spill under way; none starts after."""
        if self.spiller is not None:
            self.spiller.stop()
        with self._saving:
            self._stopped = True

    def save(self, listed: Sequence[Listed], covered: Callable[[list[int]], int]) -> None:
        """Write the hottest of the server's entries (stamp, entry; a deferred one is resolved
        here) and the restored snapshots still worth keeping, within the budget, as the new
        set; one log line."""
        if self.spiller is not None:
            self.spiller.stop()
        entries = [pair for pair in map(resolved, listed) if pair is not None]
        with self._saving:
            self._stopped = True
            self._write(entries, covered, "")

    def _spill(
        self, listed: list[tuple[int, Entry]], covered: Callable[[list[int]], int], why: str
    ) -> None:
        """A spill's write, on the spill thread (PipelineError: nothing written, the previous set
        stays); nothing after the stop's save began."""
        with self._saving:
            if not self._stopped:
                self._write(listed, covered, why)

    def _write(
        self, listed: Sequence[tuple[int, Entry]], covered: Callable[[list[int]], int], why: str
    ) -> None:
        start = time.perf_counter()
        chosen, report = self._choose(listed, covered)
        if not chosen:  # an empty set would only remove the sets there
            log.info("snapshots: nothing to save%s; the sets in %s stay", why, self.folder.root)
            return
        path = self.folder.write_set(chosen, self.context, self.key, spare=self.spare)
        skipped = ", ".join(f"{n} {reason}" for reason, n in sorted(report.skipped.items()))
        log.info(
            "snapshots: saved %d entr%s (%d tokens, %.1f MiB; budget %.1f MiB) to %s in %.1f ms%s%s",
            report.saved, "y" if report.saved == 1 else "ies", report.tokens, report.nbytes / 2**20,
            self.budget / 2**20, path, (time.perf_counter() - start) * 1000, why,
            f"; not saved: {skipped}" if skipped else "",
        )  # fmt: skip

    def _choose(
        self, listed: Sequence[tuple[int, Entry]], covered: Callable[[list[int]], int]
    ) -> tuple[list[Entry], SaveReport]:
        """Hottest first: skip what a chosen entry or a bundle already holds, what cannot be
        saved, and what no longer fits the budget."""
        shelf = [
            (s.stamp, Entry(s.tokens.tolist(), s.cache, f"snapshot {s.name}", s.lossy, None, s.depends_on))
            for s in self._served()
        ]  # fmt: skip
        report, chosen, total, trusted = SaveReport(), [], 0, self.trusted()
        for _, entry in sorted([*listed, *shelf], key=lambda p: -p[0]):
            if entry.depends_on is None:  # the server's own: what it may continue, now
                entry = replace(entry, depends_on=self.sources(entry.tokens))
            why, size = self._skip(entry, chosen, covered)
            if why is None and any(d.manifest_sha256 not in trusted for d in entry.depends_on):
                why = UNTRUSTED
            if why is None and total + size > self.budget:
                why = "over the budget"
            if why is not None:
                report.skipped[why] = report.skipped.get(why, 0) + 1
                continue
            chosen.append(entry)
            total += size
        report.saved, report.nbytes = len(chosen), total
        report.tokens = sum(len(e.tokens) for e in chosen)
        return chosen, report

    @staticmethod
    def _skip(
        entry: Entry, chosen: list[Entry], covered: Callable[[list[int]], int]
    ) -> tuple[str | None, int]:
        n = len(entry.tokens)
        if n < 2:
            return "too short", 0
        for other in chosen:
            if len(other.tokens) >= n and other.tokens[:n] == entry.tokens:
                return "held by a hotter entry", 0
        if covered(entry.tokens) >= n - 1:
            return "held by a bundle", 0
        try:
            return None, cache_facts(entry.cache)["nbytes"]
        except PipelineError:
            return "of a cache kind not saved", 0


def open_snapshots(options: Any, mounted: Any, hook: Any, held: int | None = None) -> Snapshots:
    """serve --snapshots DIR (`options`: ServeOptions): lock the folder, restore its newest set
    after the bundles `mounted` (what the server's options cannot use refused by `hook`'s rule
    for bundles), and make SIGTERM stop the server gracefully (as SIGINT does) so that the
    entries are saved."""
    budget = options.snapshot_budget  # bytes, parsed with serve's options
    template = options.passed("--chat-template")
    snapshots = Snapshots(options.snapshots, budget, options.model, template, hook.name, held)
    unusable = lambda snapshot: hook.unusable(snapshot, options)  # noqa: E731
    snapshots.trust(lambda: mounted.result.bundles)
    snapshots.restore([b.tokens for b in mounted.result.bundles], unusable)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
    return snapshots


def parent_of_snapshots(options: Any) -> int | None:
    """serve --snapshots where a spawned model process serves the mount (mlx-openai-server): DIR
    is locked now and held for this process's life, and the lock is handed to every model process
    it spawns (the same open file: DIR is never free between the check and the child's use, nor
    while the child lives); SIGTERM stops the server gracefully as SIGINT does (the model process
    is then told to stop, and saves). The lock's fd number for the child (None without
    --snapshots)."""
    if options.snapshots is None:
        return None
    global _HELD
    if _HELD is None:
        _HELD = SnapshotFolder(options.snapshots)  # a folder another serve uses is refused now
        hand_to_spawned(_HELD.lock_fd)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
    return _HELD.lock_fd


_HELD: SnapshotFolder | None = None  # the parent's DIR, held until it exits


def hand_to_spawned(fd: int) -> None:
    """Every multiprocessing `spawn` child started from now on inherits `fd` (its fds are
    closed but those passed: the lock is added to them; the resource tracker is left out, so it
    never outlives serve holding DIR)."""
    from multiprocessing import util

    spawn = util.spawnv_passfds
    if getattr(spawn, "hands", None) == fd:
        return

    def spawnv_passfds(path: Any, args: Sequence[Any], passfds: Sequence[int]) -> int:
        forked = "--multiprocessing-fork" in [str(a) for a in args]
        return spawn(path, args, [*passfds, fd] if forked else passfds)

    spawnv_passfds.hands = fd  # type: ignore[attr-defined]
    util.spawnv_passfds = spawnv_passfds


def child_snapshots(
    options: Any, mounted: Any, hook: Any, held: int | None = None
) -> Snapshots | None:
    """The model process's snapshots, under the lock its serve took and handed down (`held`),
    restored after its bundles. It ignores SIGTERM as the server makes it ignore SIGINT: a signal
    to the whole group (a service manager's stop) must not end it before its parent's orderly
    stop lets it save; the parent kills it after. None without --snapshots."""
    if options.snapshots is None:
        return None
    snapshots = open_snapshots(options, mounted, hook, held)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return snapshots


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM as SIGINT: the server stops its HTTP server and joins its threads. A second
    SIGTERM (a supervisor and its wrapper both sending one) is ignored, so it cannot cut the stop
    short; SIGKILL still can (the previous snapshot set then stays)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    log.info("SIGTERM: stopping, then saving snapshots (SIGKILL keeps the previous set)")
    raise KeyboardInterrupt


def with_snapshots(
    own: Callable[[list[int]], tuple[Any, list[int]]],
    snapshots: Snapshots | None,
    covered: Callable[[list[int]], int],
    server: str,
    answered: Callable[[str], None] | None = None,
) -> Callable[[list[int]], tuple[Any, list[int]]]:
    """The server's own fetch, or a restored snapshot where it covers more than both the
    server's own entry and every pinned bundle (`covered`; a tie goes to those: a snapshot never
    beats an exact bundle). A server entry sharing its opening with a lossy snapshot is held to
    its rule. `answered(name)` is told when a snapshot answers. `own` without --snapshots."""

    if snapshots is None:
        return own

    def fetch(tokens: list[int]) -> tuple[Any, list[int]]:
        cache, rest = own(tokens)
        held = len(tokens) - len(rest) if cache is not None else 0
        if cache is not None and held < snapshots.lossy_floor(tokens):
            cache, rest, held = None, tokens, 0
        found, keep, name = snapshot_answer(snapshots, tokens, max(held, covered(tokens)), server)
        if found is None:
            return cache, rest
        if answered is not None:
            answered(name)
        return found, list(tokens[keep:])

    return fetch


def snapshot_answer(
    snapshots: Snapshots | None, tokens: Sequence[int], better_than: int, server: str
) -> tuple[list | None, int, str]:
    """`Snapshots.fetch` for a request whose bundles and own entries cover `better_than` tokens
    (a snapshot answers only where it covers more), with the request's log line when it does;
    (None, 0, "") without --snapshots."""
    if snapshots is None:
        return None, 0, ""
    found, keep, name = snapshots.fetch(tokens, better_than)
    if found is not None:
        log.info(
            "%s request: snapshot %s covers %d of %d prompt tokens", server, name, keep, len(tokens)
        )
    return found, keep, name


__all__ = [
    "DEFAULT_BUDGET",
    "Entry",
    "Snapshots",
    "child_snapshots",
    "hand_to_spawned",
    "open_snapshots",
    "parent_of_snapshots",
    "snapshot_answer",
    "with_snapshots",
]
