"""Bundles deployed next to a model, in <model>/prefix-bundles: verify and serve find them there."""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.runtime import model_bundles_dir

from conftest import build_bundle, write_definition


@pytest.fixture
def model(tmp_path: Path, tiny_model: Path) -> Path:
    return Path(shutil.copytree(tiny_model, tmp_path / "models" / "tiny"))


@pytest.fixture
def deployed(tmp_path: Path, tiny_model: Path, model: Path) -> tuple[Path, Path]:
    """shop@1 and shop@2 built for the tiny model, copied into <model>/prefix-bundles."""
    toml = write_definition(tmp_path, tiny_model)
    v1 = build_bundle(tmp_path, check=False)
    toml.write_text(toml.read_text().replace("version = 1", "version = 2"))
    v2 = build_bundle(tmp_path, check=False)
    shutil.copytree(tmp_path / "bundles" / "shop", model_bundles_dir(model) / "shop")
    root = model_bundles_dir(model)
    return root / "shop" / "1" / v1.name, root / "shop" / "2" / v2.name


def test_the_folder_next_to_a_model(model: Path):
    assert model_bundles_dir(model) == model / "prefix-bundles"


def test_verify_without_bundles_checks_every_bundle_next_to_the_model(
    deployed: tuple[Path, Path], model: Path, capsys
):
    old, new = deployed
    assert main(["verify", "--model", str(model)]) == 0
    out = capsys.readouterr()
    assert f"newest {new}\n" in out.err and f"older  {old}\n" in out.err
    assert f"ok {old} (shop@1, " in out.out and f"ok {new} (shop@2, " in out.out

    assert main(["verify", "--model", str(model), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted(b["path"] for b in report["bundles"]) == [str(old), str(new)]

    (new / "notes.txt").write_text("x")  # an older valid bundle does not hide a broken newest
    assert main(["verify", "--model", str(model)]) == 1
    err = capsys.readouterr().err
    assert f"error: bundle {new}: unexpected 'notes.txt'" in err


def test_verify_without_bundles_and_none_found_fails_with_one_line(
    model: Path, capsys, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # no bundles/ of a project here either
    assert main(["verify", "--model", str(model)]) == 1
    folder = model / "prefix-bundles"
    assert capsys.readouterr().err == (
        f"error: no bundle arguments and no {folder}; pass bundle folders, or copy bundles "
        f"there (prefix-bundles pull --model {model} ...)\n"
    )
    (folder / "shop" / "1").mkdir(parents=True)
    assert main(["verify", "--model", str(model)]) == 1
    assert capsys.readouterr().err.startswith(f"error: no bundle in {folder}; pass bundle folders")


def test_serve_strict_without_bundles_next_to_the_model_fails_with_one_line(
    model: Path, capsys, tmp_path, monkeypatch
):
    from pipeline.cli import main as cli_main

    monkeypatch.chdir(tmp_path)  # no bundles/ of a project here either
    assert cli_main(["serve", "--model", str(model), "--strict"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f"error: bundle {model / 'prefix-bundles'}: bundles folder does not exist"
    )
    assert err.count("\n") == 1


def test_serve_mounts_the_bundles_next_to_the_model_by_default(
    deployed: tuple[Path, Path], model: Path, monkeypatch, caplog
):
    import mlx_lm.server as server

    from pipeline.cli import main as cli_main

    started = []
    monkeypatch.setattr(server, "main", lambda: started.append(list(sys.argv)))
    monkeypatch.setattr(server, "LRUPromptCache", server.LRUPromptCache)
    monkeypatch.setattr(server, "ModelProvider", server.ModelProvider)  # serve replaces it
    monkeypatch.setattr(server, "ResponseGenerator", server.ResponseGenerator)  # serve replaces it
    monkeypatch.setattr(sys, "argv", sys.argv)
    caplog.set_level(logging.INFO, logger="prefix-bundles")
    from servers_env import free_port

    port = str(free_port())
    assert cli_main(["serve", "--model", str(model), "--strict", "--port", port]) == 0
    assert started == [["mlx_lm.server", "--model", str(model), "--port", port]]
    assert (
        "mounted shop@2" in caplog.text
        and f"not mounted: older version {deployed[0]}" in caplog.text
    )
