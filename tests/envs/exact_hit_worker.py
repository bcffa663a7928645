"""Run in the server venv (mlx-lm 0.31 + the servers): each --server hook's prompt cache, holding
an entry it cannot trim (a RotatingKVCache past its window), asked for exactly that entry's tokens
and for one token more; prints one JSON line per server: what each lookup left to process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from pipeline.runtime.mount import MountResult
from pipeline.runtime.prompt_cache import PromptCacheManager
from pipeline.runtime.servers.mounted import Mounted


def rotating_entry(tokens: int) -> list:
    layer = RotatingKVCache(max_size=8, keep=0)
    layer.update_and_fetch(mx.zeros((1, 2, tokens, 16)), mx.zeros((1, 2, tokens, 16)))
    assert not layer.is_trimmable()
    return [layer]


def main() -> None:
    a = list(range(1, 21))
    mounted = Mounted(Path("."), PromptCacheManager(), MountResult())
    out = {}
    from pipeline.runtime.servers.mlx_openai import model_process
    from pipeline.runtime.servers.vllm_mlx import simple_engine

    trie = simple_engine.pinned_trie_class(mounted)(10, 1 << 30)
    trie.keep_entries = True
    model = object()
    trie.insert_cache(model, a, rotating_entry(len(a)))
    out["vllm-mlx"] = [len(trie.fetch_nearest_cache(model, t)[1]) for t in (a, [*a, 99])]

    cache = model_process.pinned_cache_class(mounted)()
    cache.insert_cache(a, rotating_entry(len(a)))
    out["mlx-openai-server"] = [len(cache.fetch_nearest_cache(t)[1]) for t in (a, [*a, 99])]
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
