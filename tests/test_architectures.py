"""Other cache kinds through the one validator: sliding-window (RotatingKVCache) and hybrid (ArraysCache)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from fuzz_corpus import edit_manifest, reseal_sums
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from pipeline.format.errors import BundleError
from pipeline.format.layout import MANIFEST_FILE
from pipeline.runtime import PromptCacheManager, mount, verify
from pipeline.testmodels.arch import generate_arch_model

from conftest import build_bundle, write_definition

EXPECTED_CLASSES = {
    "gemma3_text": ["RotatingKVCache", "RotatingKVCache", "KVCache"],
    "lfm2": ["ArraysCache", "KVCache", "ArraysCache"],
}


@pytest.fixture(scope="module", params=sorted(EXPECTED_CLASSES))
def arch_bundle(request, tmp_path_factory, tiny_model: Path) -> tuple[str, Path, Path]:
    arch = request.param
    model = generate_arch_model(tmp_path_factory.mktemp("arch") / arch, arch, tiny_model)
    root = tmp_path_factory.mktemp(f"{arch}-project")
    write_definition(root, model)
    return arch, model, build_bundle(root, check=True)


def test_builds_verifies_and_continues_like_a_cold_prefill(arch_bundle):
    arch, model_dir, bundle = arch_bundle
    manifest = verify(bundle, model_dir)
    assert manifest.cache.classes == EXPECTED_CLASSES[arch]
    assert manifest.tokens.count > 64  # longer than gemma's window: the rotating buffer wrapped
    model, _ = load(str(model_dir))
    manager = PromptCacheManager()
    mounted = mount(model_dir, bundle, manager=manager, model_key="m")
    tokens = [*mounted.bundles[0].tokens, 27, 872, 198, 13, 42]
    hit = manager.fetch("m", tokens)
    assert hit.cache_hit_tokens == manifest.tokens.count
    warm = model(mx.array(hit.remaining)[None], cache=hit.cache)[0, -1]
    cold = model(mx.array(tokens)[None], cache=make_prompt_cache(model))[0, -1]
    assert mx.max(mx.abs(warm - cold)).item() <= 1e-4


def test_a_layer_of_another_kind_is_refused(arch_bundle, tmp_path: Path):
    arch, model_dir, bundle = arch_bundle
    copy = shutil.copytree(bundle, tmp_path / "b")
    first = EXPECTED_CLASSES[arch][0]
    other = "KVCache" if first != "KVCache" else "RotatingKVCache"
    edit_manifest(lambda m: m["cache"]["classes"].__setitem__(0, other))(copy)
    reseal_sums(copy)
    with pytest.raises(BundleError):
        verify(copy, model_dir)
    assert json.loads((copy / MANIFEST_FILE).read_text())["cache"]["classes"][0] == other


def test_diverging_inside_a_non_trimmable_prefix_goes_cold(arch_bundle):
    arch, model_dir, bundle = arch_bundle
    manager = PromptCacheManager()
    mounted = mount(model_dir, bundle, manager=manager, model_key="m")
    tokens = mounted.bundles[0].tokens
    diverging = [*tokens[:100], 27, 872, 198]  # parts inside the prefix, past gemma's window
    hit = manager.fetch("m", diverging)  # rotating past its window / recurrent state: no trim
    assert hit.cache is None and hit.cache_hit_tokens == 0 and list(hit.remaining) == diverging


def test_quantized_kv_leaves_rotating_layers_unquantized(tmp_path: Path, tiny_model: Path):
    model = generate_arch_model(tmp_path / "gemma", "gemma3_text", tiny_model)
    write_definition(tmp_path, model, kv_bits=8)
    manifest = verify(build_bundle(tmp_path, check=True), model)
    assert manifest.cache.classes == ["RotatingKVCache", "RotatingKVCache", "QuantizedKVCache"]
    assert manifest.fidelity.max_abs_logit_diff <= manifest.fidelity.threshold
