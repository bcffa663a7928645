"""Every cache kind a bundle can hold, through the real `build.py serve` on both request paths.

mlx_lm.server serves a request on its own (`_serve_single`) when it has a seed (or images, a draft
model, --kv-bits) and batched otherwise; the batched path merges every layer and has no merge for
QuantizedKVCache (issue 16: the demo's 8-bit bundle killed its generation thread). Per kind, one
server holds two bundles: `shop` is first used by a seeded request (single path), `desk` by
concurrent requests (batched path), next to a request that matches no bundle. Every answer must be
the cold model's greedy tokens, the bundle hits logged, and the server still healthy.
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlx_lm import load
from mlx_lm.generate import stream_generate
from test_serve import cached, chat, server_process

from pipeline.format.bundle_folder import MANIFEST_FILE
from pipeline.testmodels.arch import generate_arch_model

from conftest import SYSTEM, TOOLS, build_bundle, write_definition

K, Q, R, A = "KVCache", "QuantizedKVCache", "RotatingKVCache", "ArraysCache"
ONE_HEAD = {"num_attention_heads": 1, "num_key_value_heads": 1}  # lfm2 head_dim 64: quantizable
AS_SERVED = {"compute_dtype": '"model"'}  # bf16 prefill as the server runs it, not float32 on CPU
KINDS = {  # kind -> (architecture, weights dtype, config overrides, cache options, classes)
    "full": ("qwen3", "float32", {}, {}, [K, K]),
    "8-bit": ("qwen3", "float32", {}, {"kv_bits": 8}, [Q, Q]),
    "4-bit": ("qwen3", "float32", {}, {"kv_bits": 4}, [Q, Q]),
    "8-bit-bf16": ("qwen3", "bfloat16", {}, {"kv_bits": 8, **AS_SERVED}, [Q, Q]),
    "rotating": ("gemma3_text", "float32", {}, {}, [R, R, K]),
    "rotating-bf16": ("gemma3_text", "bfloat16", {}, AS_SERVED, [R, R, K]),
    "rotating-8-bit": ("gemma3_text", "float32", {}, {"kv_bits": 8}, [R, R, Q]),
    "hybrid": ("lfm2", "float32", {}, {}, [A, K, A]),
    "hybrid-8-bit": ("lfm2", "float32", ONE_HEAD, {"kv_bits": 8}, [A, Q, A]),
}
DESK = (
    "You are the front desk of a small hotel. Answer in one sentence. Check-in is from 15:00, "
    "check-out until 11:00; breakfast is served 7-10 in the garden room."
)
BOUNDS = {"float32": 1e-3, "bfloat16": 0.1}  # |dlogprob| allowed for unquantized K/V, as built


def build(root: Path, model_dir: Path, name: str, system: str, cache: dict) -> Path:
    """Build prefix `name` (system text + the tools) for model_dir; the bundle folder."""
    path = write_definition(root, model_dir, name=name, **cache)
    path.write_text(path.read_text().replace(json.dumps(SYSTEM), json.dumps(system)))
    return build_bundle(root, name, check=True)


def cold(model, tokenizer, system: str | None, question: str) -> tuple[list[int], list[float]]:
    """Greedy token ids and their log-probabilities, prefilled from nothing in this process."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": question})
    prompt = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)
    out = list(stream_generate(model, tokenizer, prompt, max_tokens=12))
    return [r.token for r in out], [r.logprobs[r.token].item() for r in out]


def served(response: dict) -> tuple[list[int], list[float]]:
    """The token ids and log-probabilities a response reports (requested with logprobs)."""
    content = response["choices"][0]["logprobs"]["content"]
    return [t["id"] for t in content], [t["logprob"] for t in content]


def healthy(port: int) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as resp:
        return json.loads(resp.read()) == {"status": "ok"}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_each_cache_kind_answers_like_a_cold_model_on_both_paths(
    kind: str, tiny_model: Path, tmp_path: Path
):
    arch, dtype, overrides, cache, classes = KINDS[kind]
    model_dir = generate_arch_model(tmp_path / "model", arch, tiny_model, dtype=dtype, **overrides)
    bundles = {name: build(tmp_path, model_dir, name, text, cache) for name, text in
               (("shop", SYSTEM), ("desk", DESK))}  # fmt: skip
    manifests = {n: json.loads((b / MANIFEST_FILE).read_text()) for n, b in bundles.items()}
    assert all(m["cache"]["classes"] == classes for m in manifests.values())
    tokens = {n: m["tokens"]["count"] for n, m in manifests.items()}
    quantized = "kv_bits" in cache
    bound = manifests["shop"]["fidelity"]["threshold"] if quantized else BOUNDS[dtype]

    asked = [  # (system text, question, extra body fields); the first one is served on its own
        (SYSTEM, "Where is my order 12345?", {"seed": 0}),
        (DESK, "When is breakfast?", {}),
        (DESK, "Can I check out at noon?", {}),
        (None, "Hello?", {}),
        (SYSTEM, "And my order 777?", {}),
    ]
    log = tmp_path / "serve.log"
    with server_process(model_dir, tmp_path / "bundles", log, "--strict", "--warm-up") as (_, p):
        answers = [chat(p, q, system, logprobs=True, **extra) for system, q, extra in asked[:1]]
        with ThreadPoolExecutor(len(asked) - 1) as pool:  # concurrent: one batch
            answers += pool.map(lambda a: chat(p, a[1], a[0], logprobs=True, **a[2]), asked[1:])
        assert healthy(p)
    text = log.read_text()
    assert "2 bundle(s) mounted, 0 refused" in text and "warmed up from" in text
    assert f"request: bundle shop@1 covers {tokens['shop']} of " in text
    assert "prompt tokens (single path)" in text.split("bundle shop@1 covers", 1)[1].split("\n")[0]
    assert f"request: bundle desk@1 covers {tokens['desk']} of " in text
    assert "(batched path)" in text.split("bundle desk@1 covers", 1)[1].split("\n")[0]
    assert "generation thread died" not in text and "Traceback" not in text

    model, tokenizer = load(str(model_dir))
    worst = 0.0
    for (system, question, _), answer in zip(asked, answers, strict=True):
        ids, logprobs = served(answer)
        cold_ids, cold_logprobs = cold(model, tokenizer, system, question)
        assert ids == cold_ids, (kind, question)
        worst = max(worst, *(abs(a - b) for a, b in zip(logprobs, cold_logprobs, strict=True)))
        if system is not None:
            name = "shop" if system == SYSTEM else "desk"
            assert cached(answer) >= tokens[name]
    assert worst <= bound, (kind, worst)
    print(f"measured {kind}: served vs cold max |dlogprob| {worst:.3g} (bound {bound})")


# --- pipeline.runtime.batching: what the batched path is handed -------------------------------


def quantized_layer(tokens: int = 40, bits: int = 8):
    """A QuantizedKVCache over `tokens` random keys and values (2 heads, head_dim 64)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    mx.random.seed(3)
    layer = KVCache()
    layer.update_and_fetch(*mx.random.normal((2, 1, 2, tokens, 64)))
    return layer.to_quantized(group_size=64, bits=bits)


@pytest.mark.parametrize("bits", [8, 4])
def test_for_batching_dequantizes_a_quantized_layer_and_leaves_it_untouched(bits: int):
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from pipeline.runtime.batching import for_batching

    quantized, rotating = quantized_layer(bits=bits), RotatingKVCache(max_size=32)
    before = [mx.array(x) for x in (*quantized.keys, *quantized.values)]
    kv, same = for_batching([quantized, rotating])
    assert same is rotating and type(kv) is KVCache and kv.offset == quantized.offset == 40
    assert quantized.keys[0].shape[2] == 256  # the buffer past the offset is not handed over
    expected = mx.dequantize(*(x[..., :40, :] for x in quantized.keys), group_size=64, bits=bits)
    assert kv.keys.shape == (1, 2, 40, 64) and mx.array_equal(kv.keys, expected)
    after = (*quantized.keys, *quantized.values)
    assert all(mx.array_equal(a, b) for a, b in zip(before, after, strict=True))
    merged = KVCache.merge([kv, KVCache()])  # what the batched path does with it
    assert merged.keys.shape == (2, 2, 40, 64)


def test_for_batching_converts_inside_a_cache_list_and_names_what_it_cannot_batch():
    from mlx_lm.models.cache import CacheList, ChunkedKVCache, KVCache

    from pipeline.runtime.batching import NotBatchable, for_batching

    inner = quantized_layer()
    (converted,) = for_batching([outer := CacheList(KVCache(), inner)])
    assert type(converted.caches[1]) is KVCache and outer.caches[1] is inner
    with pytest.raises(NotBatchable) as exc:
        for_batching([KVCache(), CacheList(KVCache(), ChunkedKVCache(chunk_size=8))])
    assert str(exc.value) == "layer 1.1 is a ChunkedKVCache, which has no batched form"


def test_the_hook_hands_each_path_its_form_and_never_lets_an_unbatchable_layer_through(caplog):
    import logging

    import mlx.core as mx
    from mlx_lm.models.cache import ChunkedKVCache, KVCache, QuantizedKVCache

    from pipeline.runtime import PromptCacheManager
    from pipeline.runtime.servers.mlx_lm import bundled_prompt_cache_class
    from pipeline.runtime.servers.mounted import BUNDLE_KEY, Mounted

    manager = PromptCacheManager()
    manager.pin(BUNDLE_KEY, list(range(40)), [quantized_layer()], "q@1")
    odd = ChunkedKVCache(chunk_size=64)
    odd.update_and_fetch(mx.zeros((1, 2, 40, 64)), mx.zeros((1, 2, 40, 64)))  # 40 tokens
    manager.pin(BUNDLE_KEY, list(range(100, 140)), [odd], "odd@1")
    mounted = Mounted(Path("m"), manager, SimpleNamespace(bundles=[]))
    prompt_cache = bundled_prompt_cache_class(mounted, "m")(10)
    model = ("m", None, None)

    cache, rest = prompt_cache.fetch_nearest_cache(model, [*range(40), 7])  # batched path
    assert [type(c) for c in cache] == [KVCache] and cache[0].offset == 40 and rest == [7]
    prompt_cache.single_path = True
    cache, rest = prompt_cache.fetch_nearest_cache(model, [*range(40), 7])
    assert [type(c) for c in cache] == [QuantizedKVCache] and rest == [7]

    cache, rest = prompt_cache.fetch_nearest_cache(model, [*range(100, 140), 7])
    assert [type(c) for c in cache] == [ChunkedKVCache]  # the single path takes any kind
    prompt_cache.single_path = False
    with caplog.at_level(logging.WARNING, logger="prefix-bundles"):
        cache, rest = prompt_cache.fetch_nearest_cache(model, [*range(100, 140), 7])
    assert cache is None and rest == [*range(100, 140), 7]  # cold, never a dead thread
    assert caplog.messages[-1] == (
        "mlx_lm.server: prompt cache not reused on the batched path: "
        "layer 0 is a ChunkedKVCache, which has no batched form"
    )
    # the server's own entry, stored quantized after a single-path request, is dequantized too
    own = [*range(200, 240)]
    prompt_cache.insert_cache(model, own, [quantized_layer()])
    cache, rest = prompt_cache.fetch_nearest_cache(model, [*own, 7])
    assert [type(c) for c in cache] == [KVCache] and rest == [7]
