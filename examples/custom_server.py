"""A custom generation loop with bundles mounted: the library API in ~30 lines.

Run from the repo root after `just demo`:  python examples/custom_server.py
"""

import sys

from mlx_lm import load, stream_generate
from mlx_lm.models.cache import make_prompt_cache

from pipeline.blas import ensure_fast_blas
from pipeline.runtime import PromptCacheManager, mount

# Linux: mlx on a system OpenBLAS (~40x faster float32 matmul than mlx-cpu's own). mlx is imported
# already, so this re-executes the script once with the library in LD_PRELOAD.
BLAS = ensure_fast_blas(sys.argv[1:])
MODEL = sys.argv[1] if len(sys.argv) > 1 else "models/demo-tiny"
BUNDLES = sys.argv[2] if len(sys.argv) > 2 else "bundles"

model, tokenizer = load(MODEL)
manager = PromptCacheManager(max_entries=16, max_bytes=2 << 30)
mounted = mount(MODEL, BUNDLES, manager=manager, model_key=MODEL, skip_refused=True)
for refusal in mounted.refused:
    print(f"refused {refusal.path}: {refusal.reason}")


def answer(messages: list[dict], tools: list[dict] | None = None) -> tuple[str, int]:
    """Generate a reply, reusing the longest cached prefix; returns (text, cache_hit_tokens)."""
    tokens = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    hit = manager.fetch(MODEL, tokens)  # always leaves >= 1 token to process
    cache = hit.cache if hit.cache is not None else make_prompt_cache(model)
    out = [
        r.token
        for r in stream_generate(model, tokenizer, hit.remaining, max_tokens=32, prompt_cache=cache)
    ]
    manager.store(MODEL, tokens + out, cache)  # later turns of this conversation start warm
    return tokenizer.decode(out), hit.cache_hit_tokens


if __name__ == "__main__":
    import json
    from pathlib import Path

    print(BLAS.notice)
    for b in mounted.bundles:
        print(f"mounted {b.name}: {len(b.tokens)} tokens in {b.seconds * 1000:.1f} ms")
    folder = Path("prefixes/support-agent")  # the same system prompt and tools the bundle holds
    system = {"role": "system", "content": (folder / "system.md").read_text()}
    tools = json.loads((folder / "tools.json").read_text())
    chat = [system, {"role": "user", "content": "I was charged twice this month."}]
    reply, hit = answer(chat, tools)
    print(f"first request: {hit} prompt tokens came from the bundle")
    chat += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Thanks!"}]
    print(f"second turn: {answer(chat, tools)[1]} prompt tokens reused")
