"""A model folder whose files change between the fingerprint and the load (a deploy renaming new
weights in while a build or a serve starts, or an update before a SIGHUP): what was loaded is not
what the fingerprint says, so nothing is published, served or saved as if it were."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from pipeline.format.errors import ModelError
from pipeline.format.served_identity import settled_identity
from pipeline.runtime.mount import mount
from pipeline.runtime.prompt_cache import PromptCacheManager
from pipeline.runtime.servers.mounted import BUNDLE_KEY, Mounted
from pipeline.runtime.servers.options import ServeOptions
from pipeline.runtime.servers.startup import mount_options, remount_read

from conftest import build_bundle, write_definition

WEIGHTS = "model.safetensors"


@pytest.fixture
def model(tmp_path: Path, tiny_model: Path) -> Path:
    return Path(shutil.copytree(tiny_model, tmp_path / "model"))


def swap_weights(model: Path, other: Path) -> None:
    """What a deploy does: the new weights renamed over the old file."""
    shutil.copyfile(other / WEIGHTS, model / ".incoming")
    os.replace(model / ".incoming", model / WEIGHTS)


def test_a_build_whose_weights_are_swapped_before_its_load_publishes_nothing(
    tmp_path: Path, model: Path, tiny_model_other_weights: Path, monkeypatch
):
    """Fingerprinted as one model, prefilled with another: refused before publishing (before,
    the bundle was labelled with the old weights' fingerprint and held the new weights' KV)."""
    from pipeline.builder import builder

    write_definition(tmp_path, model)
    real = builder.load_model

    def load_after_a_deploy(model_dir: Path, *args, **kwargs):
        swap_weights(model, tiny_model_other_weights)
        return real(model_dir, *args, **kwargs)

    monkeypatch.setattr(builder, "load_model", load_after_a_deploy)
    with pytest.raises(ModelError, match=r"model folder .*model: a file the fingerprints read .* "
                       r"was replaced, edited or relinked during the build: nothing was written"):  # fmt: skip
        build_bundle(tmp_path)
    assert not list((tmp_path / "bundles").glob("shop/*/*"))


def served(model: Path, bundles: Path) -> Mounted:
    """What serve's start-up mounts (startup.mount_for without a server): the bundles checked
    against the weights fingerprinted, the folder's state kept."""
    identity, state = settled_identity(model)
    manager = PromptCacheManager()
    result = mount(model, bundles, manager=manager, model_key=BUNDLE_KEY, identity=identity)
    return Mounted(model, manager, result, state=state)


def ask(mounted: Mounted) -> tuple[object, list[int], bool]:
    """A request extending the mounted bundle, answered by the one rule (no entries of its own)."""
    tokens = [*mounted.result.bundles[0].tokens, 7, 8] if mounted.result.bundles else [1, 2, 3]
    return mounted.answer("mlx-lm", tokens, lambda t: (None, list(t)), batched=False)


def test_serve_serves_no_bundle_when_the_weights_changed_before_its_first_lookup(
    tmp_path: Path, model: Path, tiny_model_other_weights: Path, caplog
):
    """The server loads its model after serve fingerprinted the folder: a swap in between is
    seen at the first lookup; every bundle is unpinned and one ERROR line says why."""
    write_definition(tmp_path, model)
    build_bundle(tmp_path)
    bundles = tmp_path / "bundles"
    unchanged = served(model, bundles)
    assert ask(unchanged)[2] and ask(unchanged)[2]  # from the bundle, the check once
    mounted = served(model, bundles)
    swap_weights(model, tiny_model_other_weights)
    with caplog.at_level(logging.ERROR, logger="prefix-bundles"):
        cache, rest, from_bundle = ask(mounted)
    assert cache is None and not from_bundle and not mounted.result.bundles
    assert not mounted.loaded_as_fingerprinted()
    assert [r.message for r in caplog.records if "relinked" in r.message] == [
        f"model folder {model}: a file the fingerprints read (config, weights, tokenizer or "
        "template, or a link to one) was replaced, edited or relinked after serve fingerprinted "
        "it: no bundle or snapshot is "
        "served or saved by this process; restart serve"
    ]


def test_a_remount_checks_bundles_against_the_weights_the_server_runs(
    tmp_path: Path, model: Path, tiny_model_other_weights: Path, caplog
):
    """An in-place model update, a bundle built for the new weights, then SIGHUP: the new
    bundle is refused (the server still runs the old weights) and a WARNING says to restart;
    the old weights' bundle stays valid for it."""
    write_definition(tmp_path, model)
    old = build_bundle(tmp_path)
    options = ServeOptions("mlx-lm", model, tmp_path / "bundles", (), (), True)
    served = settled_identity(model)
    read = remount_read(options, mount_options(options, None, served[0].model), served)
    assert [b.path for b in read().bundles] == [old]
    swap_weights(model, tiny_model_other_weights)
    shutil.rmtree(old)
    new = build_bundle(tmp_path)  # for the weights now in the folder
    with caplog.at_level(logging.WARNING, logger="prefix-bundles"):
        result = read()
    assert not result.bundles
    assert [r.path for r in result.refused] == [new]
    assert "model" in (result.refused[0].field or "") or "weights" in result.refused[0].reason
    assert any("restart serve to serve the new weights" in r.message for r in caplog.records)


def test_a_swap_after_the_first_lookup_is_seen_at_the_next(
    tmp_path: Path, model: Path, tiny_model_other_weights: Path
):
    """The server may load its model again while it runs (mlx_lm.server drops it for a request
    naming another model, then reloads the folder as it is): the folder is checked at every
    lookup, and once it changed no bundle answers for the rest of the process."""
    write_definition(tmp_path, model)
    build_bundle(tmp_path)
    mounted = served(model, tmp_path / "bundles")
    assert ask(mounted)[2]
    swap_weights(model, tiny_model_other_weights)
    assert not ask(mounted)[2] and not mounted.result.bundles
    assert not mounted.loaded_as_fingerprinted()


def test_a_link_flipped_and_flipped_back_is_seen(
    tmp_path: Path, model: Path, tiny_model_other_weights: Path
):
    """Blue/green: the model path is a link; flipped to other weights while the server loads,
    then back before its first lookup, every file resolves to the same bytes again, but the link
    is a new one: what the server loaded is unknown, and no bundle answers."""
    write_definition(tmp_path, model)
    build_bundle(tmp_path)
    current = tmp_path / "current"
    os.symlink(model, current)
    mounted = served(current, tmp_path / "bundles")
    assert mounted.result.bundles
    for target in (tiny_model_other_weights, model):  # ln -sfn, there and back
        os.symlink(target, tmp_path / ".flip")
        os.replace(tmp_path / ".flip", current)
    assert not ask(mounted)[2] and not mounted.loaded_as_fingerprinted()
