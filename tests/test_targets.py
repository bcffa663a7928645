"""Model resolution: local folders, hub repos (offline here), fingerprint pins; serve's version pin."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from pipeline.builder.definition import ModelSpec
from pipeline.builder.targets import resolve_model
from pipeline.format.errors import ModelError, PipelineError

from conftest import build_bundle, write_definition

REVISION = "c1899de289a04d12100db370d81485cdf75e47ca"


def test_hub_model_offline_is_a_clear_error_at_once(monkeypatch, tmp_path: Path):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    spec = ModelSpec(repo="Qwen/Qwen3-0.6B", revision=REVISION)
    start = time.perf_counter()
    with pytest.raises(ModelError) as info:
        resolve_model(spec, tmp_path)
    assert time.perf_counter() - start < 1.0  # not huggingface_hub's ~25 s of retries
    assert str(info.value) == (
        f"model Qwen/Qwen3-0.6B@{REVISION}: not in the local hub cache: HF_HUB_OFFLINE is set; "
        "download it with the hub reachable (HF_HUB_OFFLINE unset, network up), "
        "or pre-download it and use models.path"
    )


def test_hub_model_in_the_local_hub_cache_resolves_offline(
    monkeypatch, tmp_path: Path, tiny_model: Path
):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    repo_cache = tmp_path / "hf" / "models--acme--tiny"
    snapshot = repo_cache / "snapshots" / REVISION
    shutil.copytree(tiny_model, snapshot)
    (repo_cache / "refs").mkdir()
    (repo_cache / "refs" / "main").write_text(REVISION)
    assert resolve_model(ModelSpec(repo="acme/tiny", revision=REVISION), tmp_path) == snapshot


def test_missing_local_model_names_the_fix(tmp_path: Path):
    with pytest.raises(
        ModelError,
        match=r"model nowhere: folder .*/nowhere does not exist; generate the demo model",
    ):
        resolve_model(ModelSpec(path="nowhere"), tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ModelError, match=r"model empty: no config.json in .*; generate the demo model"
    ):
        resolve_model(ModelSpec(path="empty"), tmp_path)


def test_fingerprint_pin_refuses_other_weights(tmp_path: Path, tiny_model_other_weights: Path):
    write_definition(tmp_path, tiny_model_other_weights, extra="")
    toml = tmp_path / "prefixes" / "shop.toml"
    toml.write_text(
        toml.read_text().replace("[[models]]\n", '[[models]]\nfingerprint = "' + "ab" * 32 + '"\n')
    )
    with pytest.raises(
        ModelError, match=r"differs from the definition's models.fingerprint abababababab"
    ):
        build_bundle(tmp_path)


def test_serve_refuses_an_unsupported_mlx_lm(monkeypatch):
    from pipeline.runtime.servers import startup
    from pipeline.runtime.servers.startup import check_mlx_lm

    monkeypatch.setattr(startup, "installed_mlx_lm", lambda: "0.40.1")
    with pytest.raises(PipelineError) as info:
        check_mlx_lm()
    assert str(info.value) == (
        "serve supports mlx-lm >=0.31,<0.33; found 0.40.1: "
        "install one with \"pip install 'mlx-lm>=0.31,<0.33'\""
    )


def test_a_model_folder_spelled_another_way_builds_the_same_bundle(
    tmp_path: Path, tiny_model: Path, monkeypatch, capsys
):
    """The bundle names a --model folder the same however the command line spells it (relative,
    absolute, through a link): the same inputs give the same bytes, so the second build is up to
    date (before: the typed path went into the cache metadata and the build key, and every other
    spelling rebuilt the bundle, dropping its signature)."""
    import json

    from pipeline.builder.definition import load_definition
    from pipeline.builder.targets import targets
    from pipeline.cli import main

    write_definition(tmp_path, tiny_model)
    link = tmp_path / "model-link"
    link.symlink_to(tiny_model)
    inside = Path(shutil.copytree(tiny_model, tmp_path / "models" / "copy"))
    monkeypatch.chdir(tmp_path)
    definition = load_definition(tmp_path / "prefixes" / "shop.toml", tmp_path)
    refs = {
        (t.model_ref, t.model_dir)
        for spelling in (None, tiny_model, Path(os.path.relpath(tiny_model)), Path("model-link"))
        for t in targets(definition, tmp_path, spelling)
    }
    assert refs == {(str(tiny_model), tiny_model.resolve())}  # the definition's own path
    for spelling in (inside, Path("models/copy"), Path("models/../models/copy")):
        (target,) = targets(definition, tmp_path, spelling)
        assert target.model_ref == "models/copy"  # not the definition's: relative to the project

    bundle = build_bundle(tmp_path)
    before = (bundle / "cache.safetensors").read_bytes()
    projects = ["--prefixes", "prefixes", "--bundles", "bundles"]
    capsys.readouterr()
    assert main([*projects, "build", "--json", "--model", os.path.relpath(tiny_model)]) == 0
    (result,) = json.loads(capsys.readouterr().out)["targets"]
    assert result["status"] == "up-to-date"
    assert (bundle / "cache.safetensors").read_bytes() == before
