"""Run in vllm-mlx's or rapid-mlx's venv: serve's hook over that server's own
MemoryAwarePrefixCache, holding entries stored the ways its scheduler stores them; checks out
each case's prompt and prints one JSON line: per case, [tokens the server is told are cached,
K/V offset of the cache it continues].

  memory_cache_worker.py vllm_mlx|rapid_mlx
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from pipeline.runtime.mount import MountResult
from pipeline.runtime.prompt_cache import PromptCacheManager
from pipeline.runtime.servers.entries import held_offset
from pipeline.runtime.servers.memory_cache import pinned_memory_cache_class
from pipeline.runtime.servers.mounted import Mounted


def kv(tokens: int) -> list:
    """A two-layer cache holding K/V for `tokens` positions."""
    layers = [KVCache() for _ in range(2)]
    for layer in layers:
        layer.update_and_fetch(mx.ones((1, 2, tokens, 64)), mx.ones((1, 2, tokens, 64)))
    return layers


def main() -> None:
    own = importlib.import_module(f"{sys.argv[1]}.memory_cache")
    mounted = Mounted(Path("."), PromptCacheManager(), MountResult())
    cache_class = pinned_memory_cache_class(mounted, own.MemoryAwarePrefixCache, sys.argv[1])
    prompt, answer = list(range(1, 201)), [900, 901, 902]
    # vllm-mlx's prompt_cache_save (when its BatchGenerator has _process_prompts): the prompt's
    # key over K/V trimmed by one ("the scheduler re-feeds the last prompt token")
    trimmed = own._trim_cache_offset(kv(len(prompt)), 1)
    stored = {  # how each scheduler stores an entry
        "prompt, K/V one short": [(prompt, trimmed)],
        "prompt and answer": [(prompt + answer, kv(len(prompt) + len(answer)))],
    }
    asked = {
        "exact": prompt,
        "extends": [*prompt, 7, 8],
        "shares part": [*prompt[:150], 7, 8],
    }
    out = {}
    for how, entries in stored.items():
        for name, tokens in asked.items():
            cache = cache_class(model=None)
            for key, layers in entries:
                cache.store(list(key), layers, evict_prefixes=False)
            found, rest = cache.fetch(list(tokens))
            got = [0, None] if found is None else [len(tokens) - len(rest), held_offset(found)]
            out[f"{how}: {name}"] = got
    print(json.dumps(out))


if __name__ == "__main__":
    main()
