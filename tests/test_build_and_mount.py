"""End to end through the public API: build a bundle, mount it, continue from it == cold prefill."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache

from pipeline.format.bundle_folder import CACHE_FILE, MANIFEST_FILE, STAGING_DIR, SUMS_FILE
from pipeline.runtime import PromptCacheManager, mount

from conftest import SYSTEM, TOOLS, build_bundle, write_definition

QUESTION = [{"role": "user", "content": "Where is my order 12345? It was due on Monday."}]


def request_tokens(tokenizer, messages=QUESTION) -> list[int]:
    """Token ids a server would compute for the full conversation (mlx_lm's own templating)."""
    full = [{"role": "system", "content": SYSTEM}, *messages]
    return list(tokenizer.apply_chat_template(full, tools=TOOLS, add_generation_prompt=True))


def greedy(model, prompt: list[int], cache, n: int = 16) -> list[int]:
    steps = generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=n)
    return [int(tok) for tok, _ in steps]


def test_mounted_bundle_continues_exactly_like_a_cold_prefill(shop_bundle: Path, tiny_model: Path):
    model, tokenizer = load(str(tiny_model))
    tokens = request_tokens(tokenizer)
    manager = PromptCacheManager()
    mounted = mount(tiny_model, shop_bundle.parents[2], manager=manager, model_key="tiny")
    assert [b.path for b in mounted.bundles] == [shop_bundle] and mounted.refused == []
    bundle_tokens = mounted.bundles[0].tokens
    assert tokens[: len(bundle_tokens)] == bundle_tokens

    hit = manager.fetch("tiny", tokens)
    assert (
        hit.cache_hit_tokens == len(bundle_tokens) and hit.remaining == tokens[len(bundle_tokens) :]
    )
    warm = model(mx.array(hit.remaining)[None], cache=hit.cache)[0, -1]
    cold = model(mx.array(tokens)[None], cache=make_prompt_cache(model))[0, -1]
    assert mx.max(mx.abs(warm - cold)).item() <= 1e-4

    warm_tokens = greedy(model, tokens[len(bundle_tokens) :], manager.fetch("tiny", tokens).cache)
    cold_tokens = greedy(model, tokens, make_prompt_cache(model))
    assert warm_tokens == cold_tokens and len(set(cold_tokens)) > 1


def test_bundle_is_readable_by_mlx_lm_load_prompt_cache(shop_bundle: Path):
    cache, metadata = load_prompt_cache(str(shop_bundle / CACHE_FILE), return_metadata=True)
    manifest = json.loads((shop_bundle / MANIFEST_FILE).read_text())
    assert len(json.loads(metadata["token_ids"])) == manifest["tokens"]["count"]
    assert cache[0].offset == manifest["tokens"]["count"]


def test_sha256sum_accepts_the_checksum_file(shop_bundle: Path):
    out = subprocess.run(
        ["sha256sum", "-c", SUMS_FILE], cwd=shop_bundle, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{CACHE_FILE}: OK\n{MANIFEST_FILE}: OK\n"


def test_same_inputs_give_identical_bytes(project: Path):
    first = build_bundle(project)
    copies = {p.name: p.read_bytes() for p in first.iterdir()}
    second = build_bundle(project, force=True)
    for name in (CACHE_FILE, MANIFEST_FILE, SUMS_FILE):
        assert (second / name).read_bytes() == copies[name], name


def test_unchanged_definition_is_up_to_date(project: Path):
    from pipeline.builder.builder import build
    from pipeline.builder.definition import load_definition
    from pipeline.builder.targets import targets

    build_bundle(project)
    definition = load_definition(project / "prefixes" / "shop.toml", project)
    (target,) = targets(definition, project)
    assert build(target, project / "bundles").up_to_date


KILL_MID_WRITE = """
import os, signal, sys
from pipeline.blas import ensure_fast_blas
ensure_fast_blas()
import mlx_lm.models.cache as cache_module
real = cache_module.save_prompt_cache
def save_then_die(path, *args, **kwargs):
    real(path, *args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
cache_module.save_prompt_cache = save_then_die
from pipeline.cli import main
sys.exit(main(["--prefixes", sys.argv[1], "--bundles", sys.argv[2], "build"]))
"""


def test_build_killed_mid_write_leaves_no_bundle(project: Path):
    bundles = project / "bundles"
    args = [sys.executable, "-c", KILL_MID_WRITE, str(project / "prefixes"), str(bundles)]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=project)
    assert proc.returncode == -9, proc.stderr
    assert not (bundles / "shop").exists()
    assert list((bundles / STAGING_DIR).iterdir())  # the half-written staging folder
    build_bundle(project)  # the next build succeeds; its CLI run also sweeps dead staging folders
    from pipeline.builder.writer import clean_staging

    clean_staging(bundles)
    assert [p.name for p in (bundles / STAGING_DIR).iterdir()] == ["locks"]


@pytest.mark.parametrize("kv_bits", [8, 4])
def test_quantized_bundle_mounts_and_stays_close(tmp_path: Path, tiny_model: Path, kv_bits: int):
    write_definition(tmp_path, tiny_model, kv_bits=kv_bits)
    bundle = build_bundle(tmp_path, check=True)
    manifest = json.loads((bundle / MANIFEST_FILE).read_text())
    assert manifest["cache"]["classes"] == ["QuantizedKVCache"] * 2
    assert (
        manifest["fidelity"]["checked"]
        and manifest["fidelity"]["max_abs_logit_diff"] <= manifest["fidelity"]["threshold"]
    )
    model, tokenizer = load(str(tiny_model))
    manager = PromptCacheManager()
    mount(tiny_model, bundle, manager=manager, model_key="tiny")
    tokens = request_tokens(tokenizer)
    hit = manager.fetch("tiny", tokens)
    assert hit.cache_hit_tokens == manifest["tokens"]["count"]
    assert model(mx.array(hit.remaining)[None], cache=hit.cache).shape[1] == len(hit.remaining)
