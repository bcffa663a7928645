"""The warm-up's check of the ids a server's own app computed (pipeline.runtime.servers.warm_up):
the comparison and its lines on a real mounted bundle. The servers' apps run it in the slow
server tests (tests/test_servers_rapid.py, tests/test_servers_vllm.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pipeline.format.errors import PipelineError
from pipeline.runtime.mount import mount
from pipeline.runtime.prompt_cache import PromptCacheManager
from pipeline.runtime.servers.mounted import BUNDLE_KEY, Mounted
from pipeline.runtime.servers.warm_up import check_seen, looked_up, recorded


def mounted(shop_bundle: Path, model: Path, strict: bool = False) -> Mounted:
    manager = PromptCacheManager()
    result = mount(model, shop_bundle.parents[2], manager=manager, model_key=BUNDLE_KEY)
    return Mounted(model, manager, result, None, strict)


def test_ids_as_built_are_one_summary_line(shop_bundle: Path, tiny_model: Path, caplog):
    m = mounted(shop_bundle, tiny_model)
    (bundle,) = recorded(m)
    caplog.set_level(logging.INFO, logger="prefix-bundles")
    check_seen("rapid-mlx", m, [bundle], {bundle.name: [*bundle.tokens, 11, 12]})
    assert "computed the ids of 1 of 1 recorded bundle(s) exactly as built" in caplog.text
    assert "WARNING" not in caplog.text


def test_ids_parting_inside_the_bundle_name_the_token_and_the_fix(
    shop_bundle: Path, tiny_model: Path, caplog
):
    m = mounted(shop_bundle, tiny_model)
    (bundle,) = recorded(m)
    at = len(bundle.tokens) // 2
    ids = list(bundle.tokens)
    ids[at] = (ids[at] + 1) % 1000
    caplog.set_level(logging.INFO, logger="prefix-bundles")
    check_seen("rapid-mlx", m, [bundle], {bundle.name: ids})
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"reuse at most {at} of its {len(bundle.tokens)} tokens" in warning
    assert (
        f"rapid-mlx's app (its whole request path) parts from the bundle at token {at}" in warning
    )
    assert "renders it" in warning  # rapid-mlx has no request code to build with: what to do
    assert "0 of 1 recorded bundle(s)" in caplog.text


def test_a_parting_the_startup_check_predicted_is_not_repeated(
    shop_bundle: Path, tiny_model: Path, caplog
):
    m = mounted(shop_bundle, tiny_model)
    (bundle,) = recorded(m)
    m.reusable[bundle.name] = 5
    caplog.set_level(logging.INFO, logger="prefix-bundles")
    check_seen("vllm-mlx", m, [bundle], {bundle.name: [*bundle.tokens[:5], 1, 2, 3]})
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_strict_refuses_a_bundle_the_app_does_not_reuse_whole(shop_bundle: Path, tiny_model: Path):
    m = mounted(shop_bundle, tiny_model, strict=True)
    (bundle,) = recorded(m)
    with pytest.raises(PipelineError, match=r"--strict: bundle .*reuse at most 3 of"):
        check_seen("rapid-mlx", m, [bundle], {bundle.name: [*bundle.tokens[:3], 1, 2]})


def test_no_lookup_seen_is_said(shop_bundle: Path, tiny_model: Path, caplog):
    m = mounted(shop_bundle, tiny_model)
    (bundle,) = recorded(m)
    check_seen("rapid-mlx", m, [bundle], {bundle.name: None})
    assert "looked up no bundle: its ids were not checked" in caplog.text


def test_looked_up_records_each_fetch_and_restores_the_manager(shop_bundle: Path, tiny_model: Path):
    m = mounted(shop_bundle, tiny_model)
    (bundle,) = recorded(m)
    asked = [*bundle.tokens, 7]
    with looked_up(m.manager) as ids:
        hit = m.manager.fetch(BUNDLE_KEY, asked)
    assert ids == [asked] and hit.cache_hit_tokens == len(bundle.tokens)
    assert "fetch" not in vars(m.manager)  # the method again, for every later request
