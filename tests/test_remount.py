"""Remount is consistent (issue 37): a new version that is refused or that the server's options
cannot use keeps the mounted one, every refusal is a WARNING, and the report names every prefix
with the bundle it serves and why."""

from __future__ import annotations

import logging
from pathlib import Path

from test_incremental import MORE, define, run_build

from pipeline.runtime import mount
from pipeline.runtime.prompt_cache import PromptCacheManager
from pipeline.runtime.remount import Remounter

from conftest import SYSTEM


def remounter(root: Path, model: Path, unusable) -> tuple[Remounter, PromptCacheManager]:
    manager = PromptCacheManager()
    first = mount(model, root / "bundles", skip_refused=True, manager=manager, model_key="m")

    def load():
        return mount(model, root / "bundles", skip_refused=True)

    return Remounter(first, manager, "m", load, unusable), manager


def test_an_unusable_new_version_keeps_the_mounted_one_like_a_refused_one(
    tmp_path: Path, tiny_model: Path, caplog
):
    root = tmp_path / "project"
    define(root, tiny_model)
    v1 = run_build(root)
    r, manager = remounter(
        root, tiny_model, lambda b: "4-bit: not usable" if b.name == "shop@2" else None
    )
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    v2 = run_build(root)
    with caplog.at_level(logging.INFO, logger="prefix-bundles"):
        changes = r.remount()
        changes.log(logging.getLogger("prefix-bundles"))
    assert changes.removed == [] and changes.kept == ["shop@1"]
    assert changes.unused == [(v2.bundle, "4-bit: not usable")]
    assert changes.serving == [("shop@1", "its new version was refused or is not usable")]
    assert [b.name for b in r.current.values()] == ["shop@1"]
    (mounted,) = r.current.values()
    assert mounted.path == v1.bundle
    assert manager.covered("m", [*mounted.tokens, 1]) == len(mounted.tokens)  # still pinned
    warning = [rec for rec in caplog.records if "not used" in rec.getMessage()]
    assert warning and warning[0].levelno == logging.WARNING


def test_a_refused_new_version_is_a_warning_and_the_old_one_is_kept(
    tmp_path: Path, tiny_model: Path, caplog
):
    root = tmp_path / "project"
    define(root, tiny_model)
    run_build(root)
    r, _ = remounter(root, tiny_model, lambda b: None)
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    v2 = run_build(root)
    (v2.bundle / "cache.safetensors").write_bytes(b"truncated")
    with caplog.at_level(logging.INFO, logger="prefix-bundles"):
        r.remount().log(logging.getLogger("prefix-bundles"))
    refused = [rec for rec in caplog.records if "remount: refused" in rec.getMessage()]
    assert refused and refused[0].levelno == logging.WARNING
    assert [b.name for b in r.current.values()] == ["shop@1"]
