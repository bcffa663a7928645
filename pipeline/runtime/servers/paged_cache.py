"""The paged prefix cache of the batched engines (vllm-mlx --continuous-batching and rapid-mlx,
each with --use-paged-cache: a `BlockAwarePrefixCache` over a `PagedCacheManager`), holding the
mounted bundles as its own blocks and answering every request through the one lookup rule: shared
by both hooks, owned by neither.

- What is held: each mounted full-precision bundle enters the engine's cache once, through its
  own `store_cache`, under a block table of its own (`prefix-bundles:NAME@VERSION`): the engine
  cuts it into its blocks and registers their hashes, so blocks a bundle shares with another
  bundle or with a stored request are one block (its dedup), and its LRU never evicts them (the
  bundle's table holds a reference). A lossy (quantized) bundle does not enter: a block cannot
  say it is lossy, so it is answered from its pinned copy under the rule, for its share only.
- How a request is answered: `Mounted.answer` compares the engine's own lookup (its block
  tables, the bundles' included) with the pinned bundles; what it hands over goes to the
  scheduler as a table whose `num_tokens` is exactly the K/V handed out (its `cached_tokens`).
- What is trusted: a block is handed out only when it holds K/V of exactly the request's tokens
  up to its end, fully backed (`history`: our own record of each block, made where the engine
  stores it; vllm-mlx 0.6 keys a block by its own tokens, not its history, and keeps index entries
  of freed blocks, so its hand-out alone is not proof).
- What snapshots get (`--snapshots`): each stored request's leading blocks proven by `history`,
  taken as new handles on the scheduler's thread at each store (`Snapshots.changed`: the spill's
  capture; FrozenBlocks), their K/V rebuilt by the engine's own `reconstruct_cache` on the spill
  thread; at the engine's stop (its deep_reset clears the cache before serve saves) what it
  held is rebuilt and kept; restored snapshots answer through the one
  rule, handed to the scheduler as a bundle's hand-out is.
- A remount (or a changed model folder) that withdraws or replaces a bundle held as blocks clears
  the engine's paged cache (its own entries too: any may continue the bundle's K/V; a request in
  flight then stores nothing) and the bundles still mounted enter again.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import logging
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from pipeline.runtime.prompt_cache import fork_cache
from pipeline.runtime.servers import usage, warm_up
from pipeline.runtime.servers.entries import evaluate, held_offset, server_entry
from pipeline.runtime.servers.memory_cache import install_memory_cache, memory_entries
from pipeline.runtime.servers.mounted import BUNDLE_KEY, Mounted

log = logging.getLogger("prefix-bundles")
TABLE = "prefix-bundles:"  # the block tables the bundles are held under: TABLE + NAME@VERSION
_ROOT = b"prefix-bundles-paged"
WITH = {  # serve's options --use-paged-cache is refused with: {attribute: (option, why)}
    "bundle_memory": (
        "--bundle-memory",
        "its blocks would hold every mounted bundle in memory, past the budget",
    ),
}


def chained(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a block's tokens after the key of every token before it."""
    ids = np.asarray(list(tokens), dtype=np.int64).tobytes()
    return hashlib.blake2b(previous + ids, digest_size=16).digest()


def pinned_paged_cache_class(
    mounted: Mounted, base: type, table: type, server: str, snapshots: Any = None
) -> type:
    """`base`, the engine's BlockAwarePrefixCache (`table`: its BlockTable), holding the mounted
    bundles as its blocks and answering through the one lookup rule (the restored `snapshots`
    too, as the memory-aware cache does); its stored requests listed for them (`entries`)."""

    class Handed(table):
        """The table the scheduler gets: `num_tokens` is the K/V handed out, and it is true
        while that is any (both schedulers test `if block_table`, which a BlockTable of no
        blocks fails: a hand-out from the pinned bundle lists none of the engine's)."""

        def __bool__(self) -> bool:
            return self.num_tokens > 0

    class PinnedPagedCache(base):
        instances: list[Any] = []

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # bundle name -> its cache file's sha256: entered since the last clear
            self.held: dict[str, str] = {}
            self.failed: dict[str, str] = {}  # bundles that could not enter (not retried)
            self.history: dict[int, tuple[bytes, int]] = {}  # block id -> (key, tokens)
            self.handed: dict[str, list] = {}  # request id -> the cache its lookup handed out
            self.epoch, self.looked_up = 0, {}  # request id -> epoch of its lookup
            self.extract: Any = None  # the scheduler's _extract_cache_states
            self.stored: dict[str, tuple[int, list[int]]] = {}  # table id -> (stamp, tokens)
            self.kept: list[tuple[int, list[int], list]] | None = None  # at the engine's stop
            PinnedPagedCache.instances.append(self)

        def fetch_cache(self, request_id: str, tokens: list[int]) -> tuple[Any, list[int]]:
            self.hold_mounted()
            self.handed.pop(request_id, None)
            self.looked_up[request_id] = self.epoch
            own = lambda t: self.own_fetch(request_id, t)  # noqa: E731
            cache, rest, _ = mounted.answer(server, tokens, own, True, snapshots)
            covered = 0 if cache is None else len(tokens) - len(rest)
            if cache is not None and held_offset(cache) != covered:  # K/V = tokens it claims
                cache, covered = None, 0
            usage.record(0, len(tokens))  # until the scheduler takes the hand-out
            if cache is None:
                return None, list(tokens)
            evaluate(cache)  # on the thread that made it (the scheduler may run it on another)
            self.handed[request_id] = cache
            return Handed(request_id, self.blocks_within(request_id, covered), covered), rest

        def reconstruct_cache(self, block_table: Any) -> Any:
            """What `fetch_cache` handed out for that table's request (None: a miss): the
            scheduler takes it here, so usage counts it here."""
            cache = self.handed.pop(getattr(block_table, "request_id", None), None)
            if cache is not None:
                usage.record(block_table.num_tokens)  # the prompt as its lookup saw it
            return cache

        def own_fetch(self, request_id: str, tokens: list[int]) -> tuple[Any, list[int]]:
            """The engine's own lookup, cut to the blocks proven to hold these tokens' K/V; not
            asked (no K/V rebuilt) where its whole blocks cannot beat the pinned bundles or a
            restored snapshot (`with_snapshots` hands that one out where it covers more)."""
            ids, _ = self.paged_cache.find_shared_prefix(list(tokens))
            restored = snapshots.covered(tokens) if snapshots is not None else 0
            if self.proven(tokens, ids) < max(mounted.covered(tokens), restored):
                return None, list(tokens)  # a bundle or a snapshot serves more
            found, _ = base.fetch_cache(self, request_id, tokens)
            if found is None or not found.block_ids:
                return None, list(tokens)
            cache = base.reconstruct_cache(self, found)  # rapid-mlx: the one its fetch built
            exact, held = self.proven(tokens, found.block_ids), held_offset(cache)
            if exact < found.num_tokens:  # the table it holds for the store is not all right
                self.drop(request_id)
            if exact == 0 or held != found.num_tokens:
                return None, list(tokens)
            return (fork_cache(cache, held - exact) if exact < held else cache), tokens[exact:]

        def proven(self, tokens: Sequence[int], block_ids: Sequence[int]) -> int:
            """How many leading tokens the blocks hold K/V of, exactly (by `history`)."""
            return self.proven_blocks(tokens, block_ids)[0]

        def proven_blocks(self, tokens: Sequence[int], block_ids: Sequence[int]) -> tuple:
            """(tokens, blocks): the leading blocks proven to hold K/V of exactly the leading
            tokens (by `history`), and how many tokens they hold."""
            key, n, k = _ROOT, 0, 0
            for block_id in block_ids:
                record = self.history.get(block_id)
                if record is None or n + record[1] > len(tokens):
                    break
                key = chained(key, tokens[n : n + record[1]])
                if key != record[0]:
                    break
                n, k = n + record[1], k + 1
            return n, k

        def blocks_within(self, request_id: str, covered: int) -> list[int]:
            """The ids of the blocks the engine holds for the request inside `covered` tokens."""
            held = self.paged_cache.get_block_table(request_id)
            ids, n = [], 0
            for block_id in held.block_ids if held is not None else ():
                n += self.history.get(block_id, (b"", covered + 1))[1]
                if n > covered:
                    break
                ids.append(block_id)
            return ids

        def store_cache(self, request_id: str, tokens: list[int], cache_data: list) -> Any:
            epoch = self.looked_up.pop(request_id, None)
            if warm_up.WARMING.is_set() or epoch != self.epoch:  # nothing stored
                self.drop(request_id)
                return None
            stored = self.store(request_id, tokens, cache_data, base.store_cache)
            if stored is not None and snapshots is not None:
                for block_id in stored.block_ids:  # evaluated on the thread that made them
                    evaluate_block(self.paged_cache.allocated_blocks.get(block_id))
                self.stored[request_id] = (snapshots.tick(), list(tokens))
                snapshots.changed()  # the scheduler's thread, which alone stores: the capture
            return stored

        def entries(self) -> list[tuple[int, list[int], list]]:
            """(stamp, tokens, K/V) of each stored request (kept at the engine's stop, else
            live): its leading blocks proven to hold K/V of exactly those tokens, rebuilt by
            the engine's own reconstruct (a copy); none held by a longer one listed, and the
            hottest only until they fill the snapshot budget (no more could be written)."""
            if self.kept is not None:
                return self.kept
            return [e for e in (rebuild() for rebuild in self.captured()) if e is not None]

        def captured(self) -> list[Callable[[], tuple[int, list[int], list] | None]]:
            """`entries` deferred: each stored request's proven blocks taken now (new handles
            over their K/V, no byte copied) and rebuilt when called, on any thread (the spill's:
            a rebuild concatenates every layer, a copy a capture on the scheduler's thread, at
            each store, must not pay); the hottest until their blocks fill the budget."""
            tables = getattr(self, "_request_tables", {})
            proven = []
            for table_id, (stamp, tokens) in list(self.stored.items()):
                held = tables.get(table_id)
                if held is None:  # released (an eviction, a clear): gone
                    self.stored.pop(table_id, None)
                    continue
                ids = list(held.block_table.block_ids)
                n, k = self.proven_blocks(tokens, ids)
                if n > 0:
                    proven.append((stamp, tokens[:n], ids[:k]))
            proven.sort(key=lambda p: -len(p[1]))
            longest: list[tuple[int, list[int], list]] = []
            for stamp, tokens, ids in proven:
                if not any(t[: len(tokens)] == tokens for _, t, _ in longest):
                    longest.append((stamp, tokens, ids))  # else a longer entry holds it
            out, budget, nbytes = [], getattr(snapshots, "budget", None), 0
            for stamp, tokens, ids in sorted(longest, key=lambda p: -p[0]):
                if budget is not None and nbytes >= budget:
                    break
                frozen = FrozenBlocks(self, base, ids)
                out.append(lambda f=frozen, s=stamp, t=tokens, i=ids: f.rebuilt(s, t, i, table))
                nbytes += frozen.nbytes
            return out

        def keep(self) -> None:
            """Hold the entries now in the cache for the save (its engine is stopping)."""
            if snapshots is not None:  # without --snapshots nothing is saved: hold nothing
                self.kept = self.entries()

        def store(self, table_id: str, tokens: list[int], states: list, store: Any) -> Any:
            """The engine's `store`, its blocks recorded; released (None) when a block it reused
            holds other tokens' K/V than these."""
            before = set(self.paged_cache.allocated_blocks)
            stored = store(self, table_id, tokens, states)
            if stored is None:
                return None
            if not self.record(tokens, stored.block_ids, before, rows(states)):
                log.warning(
                    "%s: its paged cache reused a block of other tokens for %s: not stored",
                    server, table_id,
                )  # fmt: skip
                self.drop(table_id)
                return None
            return stored

        def record(
            self, tokens: Sequence[int], block_ids: Sequence[int], before: set, backed: int
        ) -> bool:
            """Record the blocks a store made (a block wholly backed by K/V rows); False when
            one it reused (allocated before) was not recorded for these tokens."""
            key, n = _ROOT, 0
            for block_id in block_ids:
                count = self.paged_cache.allocated_blocks[block_id].token_count
                key = chained(key, tokens[n : n + count])
                if block_id in before:
                    if self.history.get(block_id) != (key, count):
                        return False
                elif n + count <= backed:
                    self.history[block_id] = (key, count)
                else:
                    self.history.pop(block_id, None)
                n += count
            return True

        def drop(self, table_id: str) -> None:
            """Release what the engine holds under a table id (its blocks' references)."""
            self.handed.pop(table_id, None)
            self.stored.pop(table_id, None)
            base.release_cache(self, table_id)  # vllm-mlx's frees only a stored entry's table
            self.paged_cache.delete_block_table(table_id)

        def release_cache(self, request_id: str) -> None:
            """The scheduler's release: an aborted or unstored request, or an entry its memory
            pressure evicts (a bundle's too: then answered from its pinned copy)."""
            self.handed.pop(request_id, None)
            self.looked_up.pop(request_id, None)
            self.stored.pop(request_id, None)
            name = request_id.removeprefix(TABLE) if request_id.startswith(TABLE) else None
            if name in self.held:  # still held: a remount withdrawing it clears the cache
                log.info(
                    "%s: it released bundle %s's blocks (memory pressure); the bundle is "
                    "answered from its pinned copy", server, name,
                )  # fmt: skip
            super().release_cache(request_id)

        def clear(self, *args: Any, **kwargs: Any) -> None:
            super().clear(*args, **kwargs)
            self.held.clear()
            self.history.clear()
            self.handed.clear()
            self.stored.clear()
            self.epoch += 1  # requests in flight store nothing

        def hold_mounted(self) -> None:
            """The bundles mounted now (full precision) held as blocks: a withdrawn or replaced
            one clears the cache, a new one enters (on the scheduler's thread, at a lookup)."""
            mounted_now = mounted.loaded_as_fingerprinted()
            bundles = {b.name: b for b in list(mounted.result.bundles)} if mounted_now else {}
            sha = {name: b.manifest.cache.file_sha256 for name, b in bundles.items()}
            gone = sorted(n for n, s in self.held.items() if sha.get(n) != s)
            if gone:
                log.info(
                    "%s: bundle(s) %s held in its paged cache were withdrawn or replaced: "
                    "the paged cache is cleared (its own entries too: any may continue "
                    "their K/V) and the mounted bundles enter again", server, ", ".join(gone),
                )  # fmt: skip
                self.clear()
            for name, b in bundles.items():
                if name not in self.held and self.failed.get(name) != sha[name]:
                    if b.manifest.cache.kv_bits or self.extract is None:
                        continue  # lossy: answered from its pinned copy, for its share only
                    self.enter(b)

        def enter(self, bundle: Any) -> None:
            """One bundle into the engine's blocks, its K/V from the pinned copy (`fetch`)."""
            tokens = list(bundle.tokens)
            with mounted.manager.provisional():
                hit = mounted.manager.fetch(BUNDLE_KEY, [*tokens, tokens[-1]])
            name, sha = bundle.name, bundle.manifest.cache.file_sha256
            before, stored = set(self.paged_cache.allocated_blocks), None
            if hit.source == f"bundle:{name}" and hit.cache_hit_tokens == len(tokens):
                stored = self.store(TABLE + name, tokens, self.extract(hit.cache), base.store_cache)
            if stored is not None:  # its blocks evaluated here, and proven to rebuild it whole
                whole = base.reconstruct_cache(self, stored)
                evaluate(whole)
                stored = stored if held_offset(whole) == len(tokens) else None
            if stored is None or stored.num_tokens != len(tokens):
                self.drop(TABLE + name)
                self.failed[name] = sha
                log.warning(
                    "%s: bundle %s did not enter its paged cache whole; it is answered from "
                    "its pinned copy", server, name,
                )  # fmt: skip
                return
            self.held[name] = sha
            shared = len(set(stored.block_ids) & before)
            log.info(
                "%s: bundle %s entered its paged cache as %d blocks (%d shared with blocks "
                "already there)", server, name, len(stored.block_ids), shared,
            )  # fmt: skip

    return PinnedPagedCache


class FrozenBlocks:
    """An engine's paged cache as its reconstruct reads it, with one table's blocks as they were
    when taken: each block's K/V under new handles (evaluated here, no byte copied), so the
    engine freeing or reusing a block later never reaches them; anything else is the engine's."""

    def __init__(self, owner: Any, base: type, ids: Sequence[int]) -> None:
        from pipeline.runtime.cache_forks import fork_value

        self._owner, self._base, self.nbytes = owner, base, 0
        blocks = {}
        for block_id in ids:
            block = owner.paged_cache.allocated_blocks.get(block_id)
            if block is not None:
                block = copy.copy(block)
                block.cache_data = fork_value(getattr(block, "cache_data", None))
                evaluate_block(block)
                self.nbytes += block_bytes(block)
            blocks[block_id] = block  # a block gone stays None: the rebuild then gives none
        self.paged_cache = SimpleNamespace(allocated_blocks=blocks)

    def __getattr__(self, name: str) -> Any:  # the engine's helpers (seq axis, concat)
        return getattr(self._owner, name)

    def rebuilt(
        self, stamp: int, tokens: list[int], ids: list[int], table: type
    ) -> tuple[int, list[int], list] | None:
        """(stamp, tokens, K/V) rebuilt by the engine's own reconstruct (rapid-mlx's from the
        table itself, not a transaction's pending cache), or None when it holds other than
        exactly `tokens`."""
        base = self._base
        rebuild = getattr(base, "_reconstruct_from_table", None) or base.reconstruct_cache
        cache = rebuild(self, table("", ids, len(tokens)))
        if cache is None or held_offset(cache) != len(tokens):
            return None
        evaluate(cache)
        return stamp, tokens, cache


def block_bytes(block: Any) -> int:
    """The bytes of the K/V a block holds."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    data = getattr(block, "cache_data", None)
    return sum(a.nbytes for _, a in tree_flatten(data or []) if isinstance(a, mx.array))


def evaluate_block(block: Any) -> None:
    """Evaluate the K/V slices a block holds (its `cache_data`), on this thread."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    data = getattr(block, "cache_data", None)
    mx.eval([a for _, a in tree_flatten(data or []) if isinstance(a, mx.array)])


def held_bytes(cache: list) -> int:
    """The bytes of the arrays a prompt cache's layers hold."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    states = [getattr(layer, "state", None) for layer in cache]
    return sum(a.nbytes for _, a in tree_flatten(states) if isinstance(a, mx.array))


def rows(states: list) -> int:
    """How many tokens every layer of an extracted cache holds K/V rows for (0: unknown)."""
    counts = set()
    for layer in states or []:
        state = layer.get("state") if isinstance(layer, dict) else None
        keys = state[0] if isinstance(state, list | tuple) and state else None
        shape = getattr(keys, "shape", None)
        counts.add(int(shape[-2]) if shape is not None and len(shape) >= 3 else 0)
    return min(counts) if counts else 0


def install_paged_cache(
    scheduler: Any, table: type, mounted: Mounted, server: str, snapshots: Any = None
) -> type:
    """Put `pinned_paged_cache_class` in the engine's `scheduler` module; each Scheduler hands
    its cache its own `_extract_cache_states` (how its store reads a prompt cache). The
    scheduler's deep_reset (its engine's stop) clears the cache before serve saves it, so what
    the cache held at that moment is kept (as install_memory_cache does)."""
    cache_class = pinned_paged_cache_class(
        mounted, scheduler.BlockAwarePrefixCache, table, server, snapshots
    )
    scheduler.BlockAwarePrefixCache = cache_class
    original, reset = scheduler.Scheduler.__init__, scheduler.Scheduler.deep_reset

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        cache = getattr(self, "block_aware_cache", None)
        if isinstance(cache, cache_class):
            cache.extract = self._extract_cache_states

    def deep_reset(self: Any, *args: Any, **kwargs: Any) -> Any:
        cache = getattr(self, "block_aware_cache", None)
        if isinstance(cache, cache_class):
            cache.keep()
        return reset(self, *args, **kwargs)

    scheduler.Scheduler.__init__ = __init__
    scheduler.Scheduler.deep_reset = deep_reset
    return cache_class


def paged_entries(
    cache_class: type, mounted: Mounted, snapshots: Any, server: str
) -> list[tuple[int, Any]]:
    """Every stored request of the paged cache(s), as (recency, snapshot Entry): the K/V its
    proven blocks hold, rebuilt by the engine's reconstruct (the bundles' tables are no entry),
    deferred while the engine serves (snapshot_spill.Listed: resolved off its thread)."""
    source = f"{server} paged prefix cache"

    def entry(stamp: int, tokens: list[int], cache: list) -> tuple[int, Any]:
        return stamp, server_entry(tokens, cache, source, mounted, snapshots)

    def deferred(rebuild: Callable[[], Any]) -> Callable[[], tuple[int, Any] | None]:
        return lambda: (lambda got: entry(*got) if got is not None else None)(rebuild())

    listed: list[Any] = []
    for instance in cache_class.instances:
        if instance.kept is not None:  # the engine stopped: what it held then
            listed += [entry(*kept) for kept in instance.kept]
        else:  # rebuilt by whoever resolves them (the spill thread; the stop's save)
            listed += [deferred(rebuild) for rebuild in instance.captured()]
    return listed


def install_batched_cache(
    scheduler: Any, paged_module: str, mounted: Mounted, server: str, rest: Sequence[str],
    snapshots: Any,
) -> Callable[[Mounted, Any], list]:  # fmt: skip
    """A batched engine's prefix cache under the rule, in its `scheduler` module: its paged
    BlockAwarePrefixCache with --use-paged-cache (`paged_module` holds its BlockTable), else its
    memory-aware cache; returns the hook's `listed` (its entries, for snapshots)."""
    if paged(rest):
        table = importlib.import_module(paged_module).BlockTable
        paged_class = install_paged_cache(scheduler, table, mounted, server, snapshots)
        return lambda m, s: paged_entries(paged_class, m, s, server)
    cache_class = install_memory_cache(scheduler, mounted, server, snapshots)
    return lambda m, s: memory_entries(cache_class, m, s, server)


def paged(rest: Sequence[str]) -> bool:
    """--use-paged-cache among the server's options."""
    return "--use-paged-cache" in rest


def refused_with(options: Any) -> dict[str, str]:
    """{"--use-paged-cache": why} where serve's options exclude it (else {})."""
    for attribute, (option, why) in WITH.items():
        if getattr(options, attribute, None) is not None:
            return {"--use-paged-cache": f"with {option}: {why}; serve without one of them"}
    return {}


__all__ = [
    "TABLE",
    "install_batched_cache",
    "install_paged_cache",
    "paged",
    "paged_entries",
    "pinned_paged_cache_class",
    "refused_with",
]
