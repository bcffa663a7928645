"""The fidelity record names its reference and compares against the serving path where it can."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.format.bundle_folder import MANIFEST_FILE
from pipeline.testmodels.model import generate_model

from conftest import build_bundle, write_definition


def fidelity(bundle: Path) -> dict:
    return json.loads((bundle / MANIFEST_FILE).read_text())["fidelity"]


def test_float32_model_serving_path_is_the_builder_path(shop_bundle: Path):
    f = fidelity(shop_bundle)
    assert f["reference"] == (
        "builder cold prefill: float32 compute on cpu, chunks of 2048 tokens, KV stored as float32"
    )
    s = f["serving"]
    assert s["same_as_builder"] and s["dtype"] == "float32" and s["chunk_tokens"] == 2048
    assert s["max_abs_logit_diff"] == 0.0 and s["greedy_match"] and f["serving_skipped"] is None
    assert s["tie_within_tolerance"] == (s["top2_margin"] <= 0.0)


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> Path:
    return generate_model(tmp_path_factory.mktemp("bf16") / "tiny-bf16", "tiny", dtype="bfloat16")


@pytest.mark.parametrize("serving", [None, True])
def test_bfloat16_model_serving_path_is_measured_or_said_to_be_skipped(
    tmp_path: Path, bf16_model: Path, serving: bool | None
):
    extra = "" if serving is None else "[check]\nserving = true\n"
    write_definition(tmp_path, bf16_model, extra="")
    path = tmp_path / "prefixes" / "shop.toml"
    path.write_text(path.read_text() + extra)
    f = fidelity(build_bundle(tmp_path, check=True))
    assert f["reference"].startswith("builder cold prefill: float32 compute on cpu")
    assert f["reference"].endswith("KV stored as bfloat16")
    if serving is None:  # a bfloat16 prefill on CPU is slow: skipped, and the manifest says so
        assert f["serving"] is None and "set check.serving = true" in f["serving_skipped"]
    else:  # measured against the server's own bfloat16 cold prefill
        s = f["serving"]
        assert s["dtype"] == "bfloat16" and not s["same_as_builder"]
        assert 0.0 < s["max_abs_logit_diff"] < 1.0 and s["top2_margin"] >= 0.0
        assert s["tie_within_tolerance"] == (s["top2_margin"] <= s["max_abs_logit_diff"])


def test_computing_in_the_model_dtype_makes_warm_equal_the_serving_path(
    tmp_path: Path, bf16_model: Path
):
    write_definition(tmp_path, bf16_model, compute_dtype='"model"')
    manifest = json.loads((build_bundle(tmp_path, check=True) / MANIFEST_FILE).read_text())
    f, s = manifest["fidelity"], manifest["fidelity"]["serving"]
    assert manifest["builder"]["compute_dtype"] == "model"
    assert f["reference"].startswith("builder cold prefill: bfloat16 compute on cpu")
    assert s["same_as_builder"] and s["max_abs_logit_diff"] == 0.0 and s["greedy_match"]


def test_quantized_bundle_records_whether_greedy_agreement_means_anything(
    tmp_path: Path, tiny_model: Path
):
    write_definition(tmp_path, tiny_model, kv_bits=4)
    f = fidelity(build_bundle(tmp_path, check=True))
    assert 0.0 < f["max_abs_logit_diff"] <= f["threshold"] and f["top2_margin"] > 0.0
    assert f["tie_within_tolerance"] == (f["top2_margin"] <= f["max_abs_logit_diff"])


def test_a_full_precision_bundle_is_proven_by_its_bytes_with_one_probe_run(
    tmp_path: Path, tiny_model: Path, monkeypatch
):
    """The read-back proves the written K/V are the builder's cache: no greedy run repeats that
    proof; where the serving path is the builder's, one probe forward gives its margin."""
    from pipeline.builder import fidelity as fidelity_module

    def no_run(*args, **kwargs):
        raise AssertionError("a model run where the bytes already prove the result")

    monkeypatch.setattr(fidelity_module, "continue_from", no_run)
    write_definition(tmp_path, tiny_model)
    f = fidelity(build_bundle(tmp_path, check=True))
    assert f["checked"] and f["max_abs_logit_diff"] == 0.0 and f["greedy_match"]
    assert f["probe"].endswith(fidelity_module.BYTE_PROOF) and f["greedy_tokens"] is None
    assert f["serving"]["same_as_builder"] and f["serving"]["top2_margin"] == f["top2_margin"]


def test_the_read_back_refuses_a_tensor_that_is_not_the_saved_one(tmp_path: Path):
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, save_prompt_cache

    from pipeline.builder.readback import read_back, saved_arrays
    from pipeline.format.errors import BuildError
    from pipeline.format.fingerprint import file_digests

    layer = KVCache()
    layer.update_and_fetch(mx.ones((1, 2, 3, 4)), mx.zeros((1, 2, 3, 4)))
    path = tmp_path / "cache.safetensors"
    save_prompt_cache(str(path), [layer], {"k": "v"})
    expected = saved_arrays([layer])
    assert read_back(path, expected) == file_digests(path)  # one read: the same digests
    expected["0.1"] = expected["0.1"] + 1  # the values, as if the disk had changed them
    with pytest.raises(BuildError, match=r"tensor 0\.1 as read back differs from the cache"):
        read_back(path, expected)
