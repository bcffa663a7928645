"""In-memory prompt-cache manager: longest-prefix reuse over pinned bundles and LRU entries."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from pipeline.format.errors import PipelineError
from pipeline.runtime import shared_kv
from pipeline.runtime.bundle_tier import BundleTier, give_back
from pipeline.runtime.cache_forks import (  # noqa: F401  (fork_cache, is_lossy: re-exported)
    cache_arrays,
    cache_offsets,
    fork_cache,
    fork_value,
    is_lossy,
)

log = logging.getLogger("prefix-bundles")

# A lossy entry (quantized KV) serves a request only when the request takes at least this share
# of it: a template's common opening tokens are never served from an approximation, and a cold
# full-precision prefill of a short shared part (under half the entry) beats reusing it lossily.
LOSSY_MIN_SHARE = 0.5


@dataclass(frozen=True)
class CacheHit:
    """What `fetch` hands out: a cache to extend (or None) and the tokens still to process."""

    cache: list | None  # ready-to-extend prompt cache, or None = start cold
    remaining: list[int]  # tokens still to process (never empty when tokens non-empty)
    cache_hit_tokens: int
    source: str  # "bundle:<name>", "entry", or "cold"


@dataclass(frozen=True)
class _Entry:
    """A cache the manager owns; its arrays are never written, only re-wrapped.

    A pinned bundle may share: it takes its first `shared` positions from `base` in the layers
    `shared_layers` (their arrays in `cache` then hold only its own tail; shared_kv). A bundle
    on disk has no `cache` and a `reload` that re-proves and reads it."""

    tokens: np.ndarray  # token ids the cache covers, exactly
    cache: list | None
    trimmable: bool
    nbytes: int  # the whole cache's bytes, shared positions included
    source: str
    lossy: bool = False  # holds quantized KV: an approximation of a full-precision prefill
    kinds: tuple = ()  # per layer, shared_kv.kind: what sharing positions requires
    base: _Entry | None = None
    shared: int = 0
    shared_layers: frozenset[int] = frozenset()
    own_bytes: int = 0  # bytes of this entry's own arrays (its tail where it shares)
    reload: Callable[[], list] | None = field(default=None, compare=False)

    def min_reuse(self) -> int:
        """The fewest tokens this entry may serve (1 for an exact entry)."""
        return lossy_min_tokens(len(self.tokens)) if self.lossy else 1


class _Withdrawn(Exception):
    """A bundle read back from disk was removed or replaced by a remount during the read."""


def lossy_min_tokens(entry_tokens: int) -> int:
    """The fewest leading tokens a request must take from a lossy entry of this length."""
    return max(1, math.ceil(entry_tokens * LOSSY_MIN_SHARE))


def _model_key(key: Any) -> str:
    """A model key as every call spells it: a path and its string (trailing slash or not) name
    the same model; PipelineError for anything else."""
    if not isinstance(key, (str, os.PathLike)):
        raise PipelineError(f"model key must be a str or a path, got {type(key).__name__}")
    return str(Path(key))


def token_ids(tokens: Any) -> np.ndarray:
    """Token ids as a 1-D int64 array; PipelineError for anything else (a batch of prompts, float
    or bool values, ids past int64: flattening, truncating or wrapping them would look up another
    prompt than the one asked for)."""
    try:
        ids = np.asarray(tokens)
    except (TypeError, ValueError, OverflowError) as exc:  # ragged lists, huge ints, odd objects
        raise PipelineError(f"token ids must be a list of whole numbers ({exc})") from None
    if ids.size == 0 and ids.ndim == 1:
        return ids.astype(np.int64)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise PipelineError(
            f"token ids must be one list of whole numbers, got a {ids.ndim}-D array of "
            f"{ids.dtype} (one prompt's ids: a list of int)"
        )
    if ids.dtype.kind == "u" and ids.size and int(ids.max()) > np.iinfo(np.int64).max:
        raise PipelineError(f"token id {int(ids.max())} is past what a token id can be")
    return ids.astype(np.int64, copy=False)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _make_entry(tokens: Sequence[int], cache: list, source: str, label: str) -> _Entry | None:
    """Own a snapshot of `cache` (new handles, materialized); None when it covers nothing."""
    if not isinstance(cache, list) or not cache:
        raise PipelineError(f"{label}: expected a prompt cache (non-empty list), got {cache!r}")
    ids = token_ids(tokens)
    offsets = cache_offsets(cache)
    if len(offsets) > 1:
        raise PipelineError(
            f"{label}: cache layers disagree on their length {sorted(offsets)}; "
            "pass the prompt cache of one model and one request"
        )
    if offsets:
        covered = offsets.pop()
        if covered > len(ids):
            raise PipelineError(
                f"{label}: cache covers {covered} tokens but {len(ids)} token ids were given; "
                "pass the token ids the cache was built from"
            )
        ids = ids[:covered]  # ids past the cache (a last sampled token) were never fed to it
    if len(ids) == 0:
        return None
    owned = [fork_value(layer) for layer in cache]
    mx.eval(list(cache_arrays(owned)))  # lazy arrays are bound to the creating thread's stream
    nbytes = sum(layer.nbytes for layer in owned)
    trimmable = all(layer.is_trimmable() for layer in owned)
    kinds = tuple(shared_kv.kind(layer) for layer in owned)
    return _Entry(ids.copy(), owned, trimmable, nbytes, source, is_lossy(owned), kinds, None, 0,
                  frozenset(), nbytes)  # fmt: skip


def _shared_form(entry: _Entry, resident: Sequence[_Entry]) -> _Entry:
    """The entry holding only what no resident entry holds already: the positions whose token
    ids and K/V bits equal a resident entry's are taken from it (shared_kv.best_base)."""
    found = shared_kv.best_base(entry, resident)
    if found is None:
        return entry
    base, n, layers = found
    own = [shared_kv.tail(x, n) if i in layers else x for i, x in enumerate(entry.cache)]
    mx.eval(list(cache_arrays(own)))
    held = sum(a.nbytes for a in cache_arrays(own))
    return replace(entry, cache=own, base=base, shared=n, shared_layers=layers, own_bytes=held)


def _on_disk(entry: _Entry) -> _Entry:
    """The entry as a bundle on disk: its facts kept, no array held."""
    return replace(entry, cache=None, base=None, shared=0, shared_layers=frozenset(), own_bytes=0)


def reusable_tokens(
    entry_tokens: Sequence[int], request: Sequence[int], trimmable: bool, lossy: bool
) -> int:
    """THE reuse rule: how many leading request tokens an entry covering `entry_tokens` can
    serve (0: it cannot serve the request). Always at least one token left to process; an entry
    whose layers cannot all be trimmed only when the request extends it whole; a lossy entry
    only for its stated share (lossy_min_tokens). serve and `match` both decide with it."""
    ids = token_ids(entry_tokens)
    req = token_ids(request)
    common, whole = _common_prefix(ids, req), len(ids)
    if trimmable:
        keep = min(common, len(req) - 1)
    else:
        keep = whole if common == whole and whole < len(req) else 0
    floor = lossy_min_tokens(whole) if lossy else 1
    return keep if keep >= floor else 0


def preference(keep: int, lossy: bool, entry_tokens: int) -> tuple[int, bool, int]:
    """How entries rank for a request: most tokens served, then an exact (full-precision) entry,
    then less trimming."""
    return (keep, not lossy, keep - entry_tokens)


def _usable(entry: _Entry, request: np.ndarray) -> int:
    return reusable_tokens(entry.tokens, request, entry.trimmable, entry.lossy)


def _best(candidates: list[_Entry], request: np.ndarray) -> tuple[_Entry | None, int]:
    """The candidate serving the most tokens by `preference`; a tie goes to the first (bundles
    come before the server's entries)."""
    best, best_rank = None, (0, False, 0)
    for entry in candidates:
        keep = _usable(entry, request)
        rank = preference(keep, entry.lossy, len(entry.tokens))
        if keep > 0 and rank > best_rank:
            best, best_rank = entry, rank
    return best, best_rank[0]


def _hand_out(entry: _Entry, keep: int, rest: int = 0) -> list:
    """A fresh cache over the entry's arrays covering its first `keep` tokens (`rest`: the
    tokens the request will add, for which an entry that shares leaves room)."""
    trim = len(entry.tokens) - keep
    if entry.base is None:
        return fork_cache(entry.cache, trim)
    out = shared_kv.hand_out(entry, keep, rest, lambda layer: fork_cache([layer], trim)[0])
    mx.eval(list(cache_arrays(out)))  # one concatenation now: usable from any thread
    return out


class PromptCacheManager:
    """Longest-common-prefix prompt cache over pinned bundles and LRU-bounded entries."""

    def __init__(
        self, max_entries: int = 10, max_bytes: int = 8 << 30, bundle_memory: int | None = None
    ) -> None:
        """Bound stored entries by count and bytes; pinned bundles count against neither.
        `bundle_memory`: the most bytes pinned bundles hold in memory (None: no bound); bundles
        pinned with a `reload` past it stay on disk and are read on a hit (BundleTier)."""
        if max_entries < 0 or max_bytes < 0 or (bundle_memory or 0) < 0:
            raise PipelineError(
                f"prompt cache limits must be >= 0 (max_entries={max_entries}, "
                f"max_bytes={max_bytes}); pass 0 to keep only pinned bundles"
            )
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._pinned: dict[str, dict[str, _Entry]] = {}
        # every lossy bundle ever pinned per model, kept after an unpin: the server's own entries
        # continued from one stay held to its rule after a remount replaces or removes it
        self._lossy_lineage: dict[str, dict[bytes, _Entry]] = {}
        # the lineage entries `fetch` handed out while the server could keep what it made of them
        # (not while `provisional`): only those can have descendants among its own entries
        self._handed_out: dict[str, set[bytes]] = {}
        self._provisional = 0
        self._entries: OrderedDict[tuple[str, bytes], _Entry] = OrderedDict()
        self._bytes = 0
        self._counts = dict(hits=0, misses=0, hit_tokens=0, evictions=0, rejected=0)
        self.tier = BundleTier(bundle_memory)
        self.bundle_memory = bundle_memory
        self._reloading = threading.Lock()  # one bundle read back from disk at a time

    def pin(
        self,
        model_key: str,
        tokens: Sequence[int],
        cache: list,
        name: str,
        *,
        reload: Callable[[], list] | None = None,
    ) -> None:
        """Mount a bundle's cache for `model_key`; never mutated by requests. Positions whose
        token ids and K/V bits equal a pinned bundle's are held once (shared_kv). `reload`
        (re-proves the bundle's files and returns its cache, PipelineError if it cannot): with
        a bundle_memory budget the bundle may then be evicted to disk and read back on a hit."""
        model_key = _model_key(model_key)
        entry = _make_entry(tokens, cache, f"bundle:{name}", f"bundle {name}")
        if entry is None:
            raise PipelineError(f"bundle {name}: its prompt cache covers no tokens; rebuild it")
        self._keep(model_key, name, replace(entry, reload=reload))

    def pin_on_disk(
        self,
        model_key: str,
        tokens: Sequence[int],
        name: str,
        *,
        reload: Callable[[], list],
        nbytes: int,
        lossy: bool,
    ) -> None:
        """Mount a bundle of plain K/V layers (every layer trimmable) without reading its
        tensors: requests find it by its token ids, and a hit reads it with `reload`."""
        model_key = _model_key(model_key)
        ids = token_ids(tokens)
        if len(ids) == 0:
            raise PipelineError(f"bundle {name}: its prompt cache covers no tokens; rebuild it")
        entry = _Entry(ids.copy(), None, True, nbytes, f"bundle:{name}", lossy, reload=reload)
        self.tier.check_fits(name, nbytes)
        with self._lock:
            self._place(model_key, name, entry)

    def fill(self, model_key: str) -> None:
        """Read bundles on disk into memory, in the order pinned, while the budget holds them
        (the bytes each would add, from its token ids shared with what is held)."""
        model_key = _model_key(model_key)
        with self._lock:
            waiting = [e for e in self._pinned.get(model_key, {}).values() if e.cache is None]
        for entry in waiting:
            with self._lock:
                resident = self._resident()
                held = shared_kv.held_bytes(resident)
            if self.tier.fits(entry, resident, held):
                self._reload(model_key, entry, quiet=True)

    def _keep(
        self, model_key: str, name: str, entry: _Entry, replacing: _Entry | None = None
    ) -> _Entry | None:
        """Hold a loaded entry (its shared form), then evict to disk what the budget cannot hold;
        the entry held, or None when nothing else could make room and it waits on disk itself
        (it can be read back: `reload`). `replacing`: the pinned entry it was read back for,
        which it replaces only while still pinned (_Withdrawn, nothing placed, where a remount
        removed or replaced it meanwhile: what it withdrew is never put back)."""
        with self._lock:
            resident = [e for e in self._resident() if e.source != entry.source]
        entry = _shared_form(entry, resident)  # compared outside the lock: entries never change
        with self._lock:
            if replacing is not None and self._pinned.get(model_key, {}).get(name) is not replacing:
                raise _Withdrawn
            self._place(model_key, name, entry)
        self._fit(model_key, name)
        with self._lock:
            kept = self._pinned.get(model_key, {}).get(name)
            if kept is None or kept.cache is None:
                return None
            if kept.reload is not None and self.tier.over(self._resident()):
                self._pinned[model_key][name] = _on_disk(kept)
                return None
        return kept

    def _place(self, model_key: str, name: str, entry: _Entry) -> None:
        """Put an entry in the pinned set (lock held)."""
        self._pinned.setdefault(model_key, {})[name] = entry
        self.tier.touch((model_key, name))
        if entry.lossy:
            self._lossy_lineage.setdefault(model_key, {})[entry.tokens.tobytes()] = entry

    def _resident(self) -> list[_Entry]:
        """Every pinned bundle held in memory (lock held)."""
        return [e for g in self._pinned.values() for e in g.values() if e.cache is not None]

    def _fit(self, model_key: str, name: str, coming: _Entry | None = None) -> None:
        """Evict least recently hit bundles that can be read back until the budget holds what is
        pinned (and `coming`, by its estimate), never (model_key, name); one line each; MLX's
        freed buffers are returned."""
        evicted = False
        while True:
            with self._lock:
                resident = self._resident()
                if coming is None and not self.tier.over(resident):
                    break
                held = shared_kv.held_bytes(resident)
                if coming is not None and self.tier.fits(coming, resident, held):
                    break
                pinned = {(k, n): e for k, g in self._pinned.items() for n, e in g.items()}
                victim = self.tier.victim(pinned, (model_key, name))
                if victim is None:
                    break
                self._pinned[victim[0]][victim[1]] = _on_disk(pinned[victim])
                held = shared_kv.held_bytes(self._resident())
            self.tier.evicted(victim[1], pinned[victim], held)
            evicted = True
        if evicted:
            give_back()

    def _reload(self, model_key: str, entry: _Entry, quiet: bool = False) -> _Entry | None:
        """A bundle on disk read back (re-proved by its `reload`) and held when the budget
        allows; None when it cannot be read back: it is unpinned and one line says so."""
        name = entry.source.removeprefix("bundle:")
        with self._reloading:
            with self._lock:
                current = self._pinned.get(model_key, {}).get(name)
            same = current is not None and (current.trimmable, current.lossy) == (
                entry.trimmable,
                entry.lossy,
            )
            if not same or not np.array_equal(current.tokens, entry.tokens):
                return None  # unpinned or replaced meanwhile: the caller looks again
            if current.cache is not None:
                return current  # read back by another request meanwhile
            start = time.perf_counter()
            try:
                cache = current.reload()
                loaded = _make_entry(current.tokens, cache, current.source, f"bundle {name}")
                if loaded is None or not np.array_equal(loaded.tokens, current.tokens):
                    raise PipelineError(f"bundle {name}: its cache no longer covers its tokens")
            except PipelineError as exc:
                with self._lock:
                    if self._pinned.get(model_key, {}).get(name) is not current:
                        return None  # a remount withdrew it meanwhile: nothing to unmount
                    del self._pinned[model_key][name]
                self.tier.failed(name, exc)
                return None
            loaded = replace(loaded, reload=current.reload)
            if not quiet:
                self._fit(model_key, name, coming=current)  # room first: then it shares what stays
            try:
                kept = self._keep(model_key, name, loaded, replacing=current)
            except _Withdrawn:
                return None  # removed or replaced meanwhile: the caller looks again
            held = kept is not None
            seconds = time.perf_counter() - start
            if quiet and held:
                self.tier.filled(name, kept)
            elif not quiet:
                self.tier.read(name, loaded, seconds, kept=held)
            return kept if held else loaded

    def covered(self, model_key: str, tokens: Sequence[int]) -> int:
        """How many leading tokens `fetch` would serve from a pinned bundle (no copy made)."""
        model_key = _model_key(model_key)
        request = token_ids(tokens)
        with self._lock:
            pinned = list(self._pinned.get(model_key, {}).values())
        return _best(pinned, request)[1] if len(request) > 1 else 0

    def unpin(self, model_key: str, name: str) -> None:
        """Forget a pinned bundle (one that cannot be used with the server's options)."""
        model_key = _model_key(model_key)
        with self._lock:
            self._pinned.get(model_key, {}).pop(name, None)
            self.tier.forget((model_key, name))

    def fetch(self, model_key: str, tokens: Sequence[int]) -> CacheHit:
        """The longest reusable cached prefix of `tokens`, as a cache the caller may change with
        MLX operations (they copy first; a NumPy view of its arrays shares the bundle's memory)."""
        model_key = _model_key(model_key)
        request = token_ids(tokens)
        while True:
            with self._lock:
                candidates = list(self._pinned.get(model_key, {}).values())
                candidates += [e for (key, _), e in self._entries.items() if key == model_key]
            best, keep = _best(candidates, request) if len(request) > 1 else (None, 0)
            if best is None or best.cache is not None:
                break
            best = self._reload(model_key, best)  # None: unpinned, so the next pass differs
            if best is not None:
                break
        if best is None:
            with self._lock:
                self._counts["misses"] += 1
            return CacheHit(None, request.tolist(), 0, "cold")
        # built outside the lock: entries are never written
        cache = _hand_out(best, keep, len(request) - keep)
        key = (model_key, best.tokens.tobytes())
        with self._lock:
            if best.source.startswith("bundle:"):
                self.tier.touch((model_key, best.source.removeprefix("bundle:")))
            if best.lossy and best.source.startswith("bundle:") and not self._provisional:
                self._handed_out.setdefault(model_key, set()).add(key[1])
            self._counts["hits"] += 1
            self._counts["hit_tokens"] += keep
            if self._entries.get(key) is best:
                self._entries.move_to_end(key)
        return CacheHit(cache, request[keep:].tolist(), keep, best.source)

    def warm_up(self, model_key: str, model: Any) -> str | None:
        """One decode step from the longest bundle pinned for `model_key`, thrown away; the
        bundle's source name, or None when none is pinned.

        A fresh process's first forward pass and first copy-on-write copy are slower than every
        later one (kernel and BLAS set-up, fresh memory faulted in); after this, MLX's kernels are
        ready and a copy of that cache's size sits in MLX's buffer cache, so the first request
        costs what an in-memory hit costs. Call it once the model is loaded, before serving.
        """
        model_key = _model_key(model_key)
        with self._lock:
            pinned = list(self._pinned.get(model_key, {}).values())
        entry = None
        for found in sorted(
            pinned, key=lambda e: (len(e.tokens), e.nbytes, e.source), reverse=True
        ):
            entry = found if found.cache is not None else self._reload(model_key, found)
            if entry is not None:
                break
        if entry is None:
            return None
        cache = _hand_out(entry, len(entry.tokens))
        logits = model(mx.array([[int(entry.tokens[-1])]]), cache=cache)
        mx.eval(logits, list(cache_arrays(cache)))
        return entry.source

    def store(self, model_key: str, tokens: Sequence[int], cache: list) -> None:
        """Keep a snapshot of a request's cache for reuse; evicts least recently used entries.

        A cache none of whose layers reports how many tokens it holds (only recurrent state) is
        not kept: the ids may include a last sampled token the state never saw, and a later
        request would continue from the wrong state.
        """
        model_key = _model_key(model_key)
        if isinstance(cache, list) and cache and not cache_offsets(cache):
            with self._lock:
                self._counts["rejected"] += 1
            return
        entry = _make_entry(tokens, cache, "entry", f"prompt cache entry for {model_key}")
        if entry is None or entry.nbytes > self.max_bytes or self.max_entries == 0:
            with self._lock:
                self._counts["rejected"] += 1
            return
        key = (model_key, entry.tokens.tobytes())
        with self._lock:
            self._drop(key)
            if entry.trimmable:  # a trimmable entry serves every prefix of itself
                for old_key, old in list(self._entries.items()):
                    if old_key[0] == model_key and _is_prefix(old.tokens, entry.tokens):
                        self._drop(old_key)
            self._entries[key] = entry
            self._bytes += entry.nbytes
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
                self._counts["evictions"] += 1

    @contextmanager
    def provisional(self) -> Iterator[None]:
        """Meanwhile, what `fetch` hands out leaves nothing behind (the warm-up: the server keeps
        no entry of it), so it makes no descendants for `lossy_floor` to hold."""
        with self._lock:
            self._provisional += 1
        try:
            yield
        finally:
            with self._lock:
                self._provisional -= 1

    def lossy_floor(
        self, model_key: str, tokens: Sequence[int], own: Sequence[Any] | None = None,
        own_tokens: int | None = None,
    ) -> int:  # fmt: skip
        """How many leading tokens of `tokens` the server's own entry must cover to be reused
        (0: any number), for entries whose history serve cannot see:
        - one that shares its opening with a lossy bundle pinned for `model_key` at any time
          in this process (a remount that replaced or removed it included), and handed out to
          a request since, may descend from it, so it is held to that bundle's rule (a lossy
          bundle no request took has no descendants: requests that merely share the template's
          opening keep the server's own cache);
        - `own` (the entry's cache, when given) holding quantized KV is itself lossy: held to
          the rule for its own length `own_tokens` (when the server tells it), else to at
          least one token (its KV never becomes the start of an unrelated prompt)."""
        model_key = _model_key(model_key)
        request = token_ids(tokens)
        with self._lock:
            taken = self._handed_out.get(model_key, set())
            lineage = [e for k, e in self._lossy_lineage.get(model_key, {}).items() if k in taken]
        floors = [e.min_reuse() for e in lineage if _common_prefix(e.tokens, request) > 0]
        if own is not None and is_lossy(own):
            floors.append(lossy_min_tokens(own_tokens) if own_tokens else 1)
        return max(floors, default=0)

    def stats(self) -> dict:
        """Counts and sizes: stored entries and pinned bundles reported separately."""
        with self._lock:
            pinned = [e for group in self._pinned.values() for e in group.values()]
            return {
                "entries": len(self._entries),
                "bytes": self._bytes,
                "max_entries": self.max_entries,
                "max_bytes": self.max_bytes,
                "pinned": len(pinned),
                "pinned_bytes": sum(e.nbytes for e in pinned),  # every bundle's whole cache
                "held_bytes": shared_kv.held_bytes(self._resident()),  # in memory, each once
                "resident": sum(e.cache is not None for e in pinned),
                "on_disk": sum(e.cache is None for e in pinned),
                "bundle_memory": self.bundle_memory,
                **self._counts,
                **self.tier.counts,
            }

    def _drop(self, key: tuple[str, bytes]) -> None:
        """Forget a stored entry (lock held)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes


def at_least_one_left(fetch: Any, tokens: list[int]) -> tuple[Any, list[int]]:
    """`fetch(tokens)` -> (cache, rest) of a server's own prompt cache, never with nothing left to
    process: an exact hit is handed out one token short (a copy: the entry stays whole) where
    every layer can trim, else replaced by the best entry for all but the last token, else cold. (mlx-lm's LRUPromptCache hands out an
    exact hit on a rotating or recurrent cache with an empty rest; its generation then fails.)"""
    cache, rest = fetch(tokens)
    if cache is None or len(rest) > 0 or not tokens:
        return cache, rest
    if all(layer.is_trimmable() for layer in cache) and len(tokens) > 1:
        # cut from a copy-on-write copy: some servers hand out the stored state itself
        # (vllm-mlx's and rapid-mlx's memory-aware cache on an exact hit)
        return fork_cache(cache, 1), tokens[-1:]
    if len(tokens) < 2:
        return None, tokens
    shorter, rest = fetch(tokens[:-1])
    covered = len(tokens) - 1 - len(rest)
    if shorter is None or covered <= 0:
        return None, tokens
    return shorter, tokens[covered:]


def _is_prefix(short: np.ndarray, long: np.ndarray) -> bool:
    """True when `short` is a strict prefix of `long`."""
    return len(short) < len(long) and _common_prefix(short, long) == len(short)


_arrays = cache_arrays  # the name tests/test_prompt_cache.py imports
