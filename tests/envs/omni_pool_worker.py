"""Run in the server venv: serve's hook over omni 0.5.3's own PromptCachePool and PromptCache.
Each case stores entries as omni's generation leaves them, checks one out for a prompt and runs
omni's own get_prompt_cache on it; prints one JSON line: per case, the tokens omni reuses, the
tokens it processes, the KV offset it continues from, and whether that KV is quantized.

  omni_pool_worker.py MODEL_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from pipeline.runtime.mount import MountResult
from pipeline.runtime.prompt_cache import PromptCacheManager, is_lossy
from pipeline.runtime.servers.mounted import Mounted

LAYERS = 2


def kv(tokens: int, bits: int | None = None) -> list:
    """A cache holding KV for `tokens` positions (quantized to `bits` when given)."""
    layers = [KVCache() for _ in range(LAYERS)]
    for layer in layers:
        layer.update_and_fetch(mx.ones((1, 2, tokens, 64)), mx.ones((1, 2, tokens, 64)))
    return [layer.to_quantized(group_size=32, bits=bits) for layer in layers] if bits else layers


def run(pool_class: type, key: str, stored: list, prompt: list[int]) -> list:
    """[cached, processed, KV offset omni continues from, lossy] for `prompt` after `stored`."""
    from mlx_omni_server.chat.mlx.prompt_cache import PromptCache

    pool = pool_class()
    for tokens, cache in stored:
        pool.put_cache(PromptCache(list(tokens), cache, key))
    out = pool.get_cache(prompt, key)
    model = SimpleNamespace(model_id=key, model=SimpleNamespace(layers=[0] * LAYERS))
    model.draft_model = None
    rest, cached = out.get_prompt_cache(model, prompt)
    return [cached, len(rest), out.cache[0].offset, is_lossy(out.cache)]


def main() -> None:
    from pipeline.runtime.servers.mlx_omni.pool import model_folder, pinned_pool_class

    key = sys.argv[1]
    mounted = Mounted(Path(key), PromptCacheManager(), MountResult())
    mounted.loaded_as_fingerprinted = lambda: True
    assert model_folder(key) == Path(key).resolve()
    pool_class = pinned_pool_class(mounted)
    a = list(range(1, 25))
    cases = {
        # omni's generation leaves KV for one token more than it records
        "extends": ([(a, kv(len(a) + 1))], [*a, 90, 91]),
        "shares part": ([(a, kv(len(a) + 1))], [*a[:20], 90, 91]),
        "exact": ([(a, kv(len(a)))], a),  # omni re-feeds the last token of an exact hit
        # a 4-bit entry: for half its tokens or more, else never handed out (not even to 0)
        "4-bit half": ([(a, kv(len(a), 4))], [*a[:12], 90]),
        "4-bit under half": ([(a, kv(len(a), 4))], [*a[:11], 90, 91]),
        "4-bit one token": ([(a, kv(len(a), 4))], [a[0], 90, 91, 92]),
    }
    print(json.dumps({name: run(pool_class, key, *case) for name, case in cases.items()}))


if __name__ == "__main__":
    main()
