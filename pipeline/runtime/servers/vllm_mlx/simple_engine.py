"""vllm-mlx's SimpleEngine (its default engine) answering from the pinned bundles: vllm-mlx-only
code, installed by the vllm-mlx hook (this room's __init__.py) when it runs without --continuous-batching.

SimpleEngine answers chat requests from a system-prompt snapshot cache and, with
`--prefix-trie-cache`, from mlx-lm's `LRUPromptCache` (a token trie consulted on the generation
worker). `install` makes that trie always present and puts a subclass there whose lookups also
answer from the pinned bundles (never evicted: they live outside the trie's LRU). Without
`--prefix-trie-cache` the trie keeps no request entries, so vllm-mlx caches exactly as it does on
its own; the bundles are only an extra answer to its lookups. Its system-prompt snapshots are
followed (usage, the lookup's slack, --snapshots) and its text chats routed through the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from pipeline.runtime.servers import usage, warm_up
from pipeline.runtime.servers.entries import server_entry
from pipeline.runtime.servers.lru_cache import lru_entries, pinned_lru_class
from pipeline.runtime.servers.mounted import Mounted
from pipeline.runtime.servers.vllm_mlx import usage_binding

SERVER = "vllm-mlx"
CACHE_OFF = {  # options under which SimpleEngine 0.6.0 builds a fresh cache for every request
    "--enable-mtp": "multi-token prediction",
    "--max-kv-size": "a bounded KV size (its own RotatingKVCache)",
    "--specprefill-draft-model": "a speculative-prefill draft model",
}


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Ids for a rendered prompt as its engine encodes one: special tokens unless it has a BOS."""
    bos = getattr(tokenizer, "bos_token", None)
    return list(tokenizer.encode(text, add_special_tokens=bos is None or not text.startswith(bos)))


def SNAPSHOT_SLACK(system: int) -> int:  # noqa: N802 - a rule, named as the constant it was
    """How far short of the system prefix a bundle may end and still be used: a bundle of that
    prefix ends a few tokens early (its stable cut drops the turn's closing tokens)."""
    return max(16, system // 20)


def snapshot_tokens(tokens: list[int]) -> int:
    """How many leading tokens SimpleEngine's system-prompt snapshot would serve for this
    request (0: it keeps none for it): its system prefix, when the prompt extends it."""
    system = usage_binding.worker_system_ids()
    if not system or len(tokens) <= len(system) or tokens[: len(system)] != system:
        return 0
    return len(system)


def follow_system_snapshots(engine_module: Any, engine_class: type, seen: SystemIds) -> None:
    """Tell the lookup and the usage fields about SimpleEngine's own system-prompt snapshots:
    the prefix it would keep (encoded as it encodes it), and a hit on one (its restore); `seen`
    (for --snapshots) learns each prefix's ids under the key vllm-mlx files its snapshot by."""
    build = engine_module.build_system_prompt_cache_prefix

    encoded: dict[tuple[int, str], list[int]] = {}  # requests repeat a few system prefixes

    def build_prefix(tokenizer: Any, *args: Any, **kwargs: Any) -> str | None:
        text = build(tokenizer, *args, **kwargs)
        if text:  # encoded as its engine encodes a rendered prompt, once per prefix (~20 ms at 11k)
            ids = encoded.get((id(tokenizer), text))
            if ids is None:
                ids = encoded[(id(tokenizer), text)] = encode_prompt(tokenizer, text)
                if len(encoded) > 16:
                    encoded.pop(next(iter(encoded)))
            usage_binding.note_system_ids(ids)
            seen.note(text, ids)
        return text

    restore = engine_class._restore_prompt_cache.__func__

    def restore_snapshot(cls: type, prompt_cache: list, snapshot: list) -> Any:
        result = restore(cls, prompt_cache, snapshot)
        system = usage_binding.worker_system_ids()
        if system:  # a snapshot hit serves the system prefix
            usage.record(len(system))
        return result

    engine_module.build_system_prompt_cache_prefix = build_prefix
    engine_class._restore_prompt_cache = classmethod(restore_snapshot)


def pinned_trie_class(mounted: Mounted, snapshots: Any = None) -> type:
    """mlx-lm's LRUPromptCache, also answering from the pinned bundles and restored `snapshots`;
    request entries are stored only when the user asked for --prefix-trie-cache (keep_entries)."""
    from mlx_lm.models.cache import LRUPromptCache

    class PinnedTrie(pinned_lru_class(LRUPromptCache, mounted, snapshots, SERVER)):
        keep_entries = False
        model_key: Any = None  # the key its entries are stored under, once it stores one

        @staticmethod
        def key(model: Any) -> tuple[str, int]:
            # vllm-mlx passes the model (an unhashable dict subclass) where mlx-lm's trie wants a
            # hashable key: every lookup of its own trie fails with TypeError (vllm-mlx 0.6.0 +
            # mlx-lm 0.31.3); one model per engine, so its identity is the key
            return ("model", id(model))

        def __len__(self) -> int:
            # vllm-mlx skips an empty trie on a system snapshot hit: never empty, so its peek
            # (_peek: the bundles, snapshots, the prompt's length for usage) runs every request
            return max(1, super().__len__())

        def insert_cache(self, model: Any, tokens: list[int], prompt_cache: Any, **kw: Any) -> None:
            if warm_up.WARMING.is_set():
                return
            if self.keep_entries:
                self.model_key = self.key(model)
                super().insert_cache(self.model_key, tokens, prompt_cache, **kw)
                self.stamped(tokens, prompt_cache)
            elif snapshots is not None:  # a request ended on the worker: its system snapshots
                snapshots.changed()

        def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[Any, list[int]]:
            own = super().fetch_nearest_cache
            fetch = lambda t: own(self.key(model), t)  # noqa: E731
            # SimpleEngine generates one request at a time (stream_generate): no merge needed
            cache, rest, from_bundle = self.answer(tokens, fetch, False, key=self.key(model))
            system = snapshot_tokens(tokens)
            if from_bundle and len(tokens) - len(rest) < system - SNAPSHOT_SLACK(system):
                # a bundle well short of the system prefix (a template's opening, an older
                # version's start): vllm-mlx's own snapshot of that prefix, taken only on a
                # trie miss, serves the whole prefix from the next request on
                cache, rest, _ = self.answer(tokens, fetch, False, False, self.key(model))
            usage.record(0 if cache is None else len(tokens) - len(rest), len(tokens))
            return cache, rest

    return PinnedTrie


def install(mounted: Mounted, snapshots: Any) -> Callable[..., list]:
    """Patch vllm-mlx's SimpleEngine so its prompt trie exists and answers from the bundles (and
    snapshots); returns what lists its trie's entries and system-prompt snapshots at a stop."""
    from vllm_mlx.engine.simple import SimpleEngine

    trie_class = pinned_trie_class(mounted, snapshots)
    seen = SystemIds(snapshots)
    original_init, original_stop = SimpleEngine.__init__, SimpleEngine.stop
    original_peek = SimpleEngine._peek_prefix_trie_tokens_saved

    def __init__(self: Any, *a: Any, **kw: Any) -> None:
        original_init(self, *a, **kw)
        seen.engine = self  # its system-prompt snapshots, listed for a spill while it serves
        self._bundles_keep_entries = self._prefix_trie_cache_enabled
        self._prefix_trie_cache_enabled = True

    def _ensure_prefix_trie_cache(self: Any) -> Any | None:
        if self._is_mllm:
            return None
        with self._prefix_trie_cache_lock:
            if self._prefix_trie_cache is None:
                mb = self._prefix_trie_cache_memory_mb
                trie = trie_class(self._prefix_trie_cache_size, mb << 20 if mb else 1 << 63)
                trie.keep_entries = self._bundles_keep_entries
                self._prefix_trie_cache = trie
        return self._prefix_trie_cache

    def _peek(prefix_trie: Any, model: Any, tokens: list[int]) -> int | None:
        # vllm-mlx peeks into the trie before preferring it to a system snapshot
        if not isinstance(prefix_trie, trie_class):
            return original_peek(prefix_trie, model, tokens)
        usage.note_prompt(len(tokens))  # a system snapshot hit skips the lookup that counts it
        own = original_peek(prefix_trie, prefix_trie.key(model), tokens)
        shelf = snapshots.covered(tokens) if snapshots is not None else 0
        return max(own or 0, mounted.covered(tokens), shelf)

    async def stop(self: Any) -> None:  # it drops its system-prompt snapshots
        seen.keep(self._system_kv_cache)
        await original_stop(self)

    SimpleEngine.__init__ = __init__
    SimpleEngine._ensure_prefix_trie_cache = _ensure_prefix_trie_cache
    SimpleEngine._peek_prefix_trie_tokens_saved = staticmethod(_peek)
    SimpleEngine.stop = stop
    route_text_chat_through_the_cache(SimpleEngine)
    from vllm_mlx.engine import simple

    follow_system_snapshots(simple, SimpleEngine, seen)
    # cached tokens in its responses: counted by the trie lookup on the generation worker
    usage_binding.bind_runs(SimpleEngine, "_run_blocking_serialized")

    def listed(mounted: Mounted, snapshots: Any) -> list:
        tries = [t for t in trie_class.instances if t.model_key is not None]
        own = [e for t in tries for e in lru_entries(t, t.model_key, mounted, snapshots, SERVER)]
        return own + seen.entries(mounted, snapshots)

    return listed


class SystemIds:
    """SimpleEngine files a system-prompt snapshot (the cache states after its system prefix)
    under sha256(prefix text)[:16] with its token count only: for --snapshots, the ids of each
    prefix as its engine encodes them and when a request last used it, and the snapshots it
    held when it stopped (`keep`)."""

    def __init__(self, snapshots: Any) -> None:
        self.snapshots = snapshots
        self.by_hash: dict[str, tuple[list[int], int]] = {}
        self.kept: list[tuple[int, list[int], list]] | None = None  # at its stop
        self.engine: Any = None

    def note(self, text: str, ids: list[int]) -> None:
        if self.snapshots is None:
            return
        self.by_hash[hashlib.sha256(text.encode()).hexdigest()[:16]] = (ids, self.snapshots.tick())
        if len(self.by_hash) > 256:  # far more than vllm-mlx keeps (its capacity: 8 by default)
            self.by_hash.pop(next(iter(self.by_hash)))

    def keep(self, system_kv_cache: Any) -> None:
        """At its stop (which drops them): the system-prompt snapshots it holds."""
        self.kept = self.held(system_kv_cache)

    def held(self, system_kv_cache: Any) -> list[tuple[int, list[int], list]]:
        """(recency, ids, KVCache layers) of each system-prompt snapshot whose ids are known."""
        from mlx_lm.models.cache import KVCache

        out = []
        for key, (states, count) in list(system_kv_cache.items()):
            ids, recency = self.by_hash.get(key, (None, 0))
            if ids is None or len(ids) != count:
                continue
            if not all(isinstance(s, tuple) and len(s) == 2 for s in states):
                continue  # not all KVCache layers (an ArraysCache's state is a list)
            layers = [KVCache() for _ in states]
            for layer, state in zip(layers, states, strict=True):
                layer.state = state
            out.append((recency, ids, layers))
        return out

    def entries(self, mounted: Mounted, snapshots: Any) -> list:
        """Those kept at its stop, else (a spill while it serves, on its worker) those it holds."""
        held = self.kept
        if held is None:
            live = getattr(self.engine, "_system_kv_cache", None)
            held = self.held(live) if live is not None else []
        source = f"{SERVER} system-prompt snapshot"
        return [(r, server_entry(ids, c, source, mounted, snapshots)) for r, ids, c in held]


def route_text_chat_through_the_cache(engine_class: type) -> None:
    """SimpleEngine.chat sends requests with tools through its stream_chat (the path that looks
    up the prompt cache and its system snapshots) and text-only ones through a blocking call that
    uses no cache at all; under serve every text request takes the stream_chat path, aggregated
    as vllm-mlx aggregates tool requests (its chat() with an empty tool list)."""
    original_chat = engine_class.chat

    async def chat(self: Any, messages: list, *a: Any, **kw: Any) -> Any:
        tools = kw.get("tools")
        media = kw.get("images") or kw.get("videos")
        if self._is_mllm or tools or media or kw.get("logits_processors"):
            return await original_chat(self, messages, *a, **kw)
        from vllm_mlx.api.utils import clean_output_text
        from vllm_mlx.engine.base import GenerationOutput

        final = GenerationOutput(text="")
        async for output in self.stream_chat(messages, *a, **kw):
            final = output
        return dataclasses.replace(final, text=clean_output_text(final.text))

    engine_class.chat = chat


@cache
def unusable_reason(model: Path, rest: tuple[str, ...]) -> str | None:
    """Why vllm-mlx's SimpleEngine would never reuse a bundle for this model with these options,
    asked of its own probe (the model built from config.json, without weights); None when it will."""
    from vllm_mlx.engine.simple import SimpleEngine

    from pipeline.format.cache_state import lazy_model
    from pipeline.format.fingerprint import model_config

    for option, what in CACHE_OFF.items():
        if any(a == option or a.startswith(option + "=") for a in rest):
            return f"{option}: with {what} vllm-mlx's SimpleEngine reuses no prompt cache"
    if not SimpleEngine._probe_system_kv_cache_support(lazy_model(model_config(model)), SERVER):
        return (
            "vllm-mlx's SimpleEngine reuses no prompt cache for this model's cache classes (its "
            "own probe: only KVCache and ArraysCache; requests run uncached); serve it with "
            "mlx_lm.server (serve without --server) to use the bundle"
        )
    return None


def leave_no_system_snapshot(server: Any) -> Callable[[], Callable[[], None]]:
    """For the warm-up request: what drops the system-prompt snapshots it makes."""

    def leave_none() -> Callable[[], None]:
        snapshots = getattr(server._engine, "_system_kv_cache", None) or {}
        before = set(snapshots)

        def undo() -> None:
            for key in set(snapshots) - before:
                snapshots.pop(key, None)

        return undo

    return leave_none
