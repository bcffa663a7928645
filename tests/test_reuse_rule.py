"""The reuse rule on every cache kind the builder makes (issue 28): warm equals cold for short
shared openings, one-token overlaps, exact hits, one-token-short hits and extensions, with
no difference beyond the documented rule (a lossy bundle serves only requests taking at least
half of it, within its recorded fidelity bound; everything else is cold or exact)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from test_serve_cache_kinds import BOUNDS, KINDS

from pipeline.format.manifest import Manifest
from pipeline.runtime import PromptCacheManager, mount
from pipeline.runtime.prompt_cache import lossy_min_tokens
from pipeline.testmodels.arch import generate_arch_model

from conftest import TOOLS, build_bundle, write_definition


@pytest.fixture(scope="module", params=list(KINDS))
def kind(request, tmp_path_factory, tiny_model: Path):
    arch, dtype, overrides, cache, _ = KINDS[request.param]
    root = tmp_path_factory.mktemp(f"rule-{request.param}")
    model_dir = generate_arch_model(root / "model", arch, tiny_model, dtype=dtype, **overrides)
    write_definition(root, model_dir, **cache)
    bundle = build_bundle(root, check=True)
    manifest = Manifest.model_validate_json((bundle / "manifest.json").read_text())
    model, tokenizer = load(str(model_dir))
    return request.param, model_dir, bundle, manifest, model, tokenizer


def logits_after(model, cache, tokens: list[int]) -> mx.array:
    cache = cache if cache is not None else make_prompt_cache(model)
    out = model(mx.array(tokens)[None], cache=cache)[0, -1].astype(mx.float32)
    mx.eval(out)
    return out


def requests(tokenizer, prefix: list[int]) -> dict[str, list[int]]:
    user_only = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello, who are you?"}], add_generation_prompt=True
    )
    half = lossy_min_tokens(len(prefix))
    return {
        "opening": list(user_only),  # shares only the template's opening tokens
        "one-token": [prefix[0], *tokenizer.encode(" something else entirely")],
        "below-half": [*prefix[: half - 1], *tokenizer.encode(" no")],
        "half": [*prefix[:half], *tokenizer.encode(" no")],
        "one-short": prefix[:-1],
        "exact": list(prefix),
        "extend": [*prefix, *tokenizer.encode(" Where is my order?")],
        "other-system": list(
            tokenizer.apply_chat_template(
                [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
                tools=TOOLS,
                add_generation_prompt=True,
            )
        ),
    }


def test_warm_equals_cold_except_where_the_rule_allows_a_bounded_lossy_reuse(kind):
    name, model_dir, bundle, manifest, model, tokenizer = kind
    manager = PromptCacheManager()
    (b,) = mount(model_dir, bundle, manager=manager, model_key="m").bundles
    lossy = manifest.cache.kv_bits is not None
    floor = lossy_min_tokens(len(b.tokens)) if lossy else 1
    trims = all(layer.is_trimmable() for layer in b.cache)
    bound = manifest.fidelity.threshold if lossy else BOUNDS[KINDS[name][1]]
    for label, tokens in requests(tokenizer, b.tokens).items():
        hit = manager.fetch("m", tokens)
        assert hit.remaining and hit.remaining == tokens[hit.cache_hit_tokens :]
        if lossy:
            assert hit.cache is None or hit.cache_hit_tokens >= floor, (name, label)
        cold = logits_after(model, None, tokens)
        warm = logits_after(model, hit.cache, hit.remaining)
        diff = float(mx.max(mx.abs(warm - cold)).item())
        if hit.cache is None:
            assert diff == 0.0, (name, label)  # cold is cold, bit for bit
        else:
            assert diff <= bound, (name, label, diff, bound)
        if label in ("opening", "one-token", "below-half", "other-system") and lossy:
            assert hit.cache is None, (name, label, hit.cache_hit_tokens)
        if label == "extend" or (label in ("half", "one-short", "exact") and trims):
            assert hit.cache is not None, (name, label)
    short = manifest.fidelity.shortest_reuse
    assert (short is not None) == (lossy and trims), name
    if short is not None:
        assert short.tokens == floor and short.max_abs_logit_diff <= manifest.fidelity.threshold
