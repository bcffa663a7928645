"""Incremental builds: a build that starts from an earlier bundle gives the bytes of a full build,
records its parent, and refuses a parent that could not give those bytes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.builder.builder import BuildResult, build
from pipeline.builder.definition import load_definition
from pipeline.builder.targets import targets
from pipeline.format.bundle_folder import CACHE_FILE, MANIFEST_FILE, SUMS_FILE
from pipeline.format.errors import BuildError
from pipeline.format.fingerprint import model_identity
from pipeline.format.validate import validate

from conftest import SYSTEM, write_definition

STEP = 16  # small chunks so the tiny prefix spans many of them
MORE = " Returns are accepted within thirty days with the receipt; gift cards are final."
ROOT = Path(__file__).resolve().parent.parent


def define(
    root: Path, model: Path, name: str = "shop", version: int = 1, system: str = SYSTEM, **cache
):
    """prefixes/<name>.toml with this system text and version (chunks of STEP unless given)."""
    path = write_definition(root, model, name, **{"prefill_step_size": STEP, **cache})
    text = path.read_text().replace(json.dumps(SYSTEM), json.dumps(system))
    path.write_text(text.replace("version = 1", f"version = {version}"))
    return path


def run_build(root: Path, name: str = "shop", bundles: Path | None = None, **kwargs) -> BuildResult:
    definition = load_definition(root / "prefixes" / f"{name}.toml", root)
    (target,) = targets(definition, root)
    return build(target, bundles or root / "bundles", **kwargs)


def without_parent(bundle: Path) -> dict:
    manifest = json.loads((bundle / MANIFEST_FILE).read_text())
    manifest.pop("parent", None)
    return manifest


def cache_sum(bundle: Path) -> list[str]:
    return [ln for ln in (bundle / SUMS_FILE).read_text().splitlines() if ln.endswith(CACHE_FILE)]


def assert_same_as_full_build(result: BuildResult, root: Path, name: str, tmp_path: Path) -> None:
    """The incremental bundle's cache file, SHA256SUMS line and manifest (but for `parent`) are
    those of a build from token 0 in an empty bundles folder."""
    checked = result.manifest.fidelity.checked
    full = run_build(root, name, bundles=tmp_path / "full-build", incremental=False, check=checked)
    assert full.manifest.parent is None and full.report["reused_tokens"] == 0
    assert "parent" not in json.loads((full.bundle / MANIFEST_FILE).read_text())
    assert (result.bundle / CACHE_FILE).read_bytes() == (full.bundle / CACHE_FILE).read_bytes()
    assert without_parent(result.bundle) == without_parent(full.bundle)
    assert cache_sum(result.bundle) == cache_sum(full.bundle)


@pytest.mark.parametrize(
    "step", [STEP, 256], ids=["chunks-replayed", "chunks-of-mlx-lm-growth-step"]
)
def test_a_new_version_with_appended_text_starts_from_the_old_one(
    tmp_path: Path, tiny_model: Path, step: int
):
    """Chunks of 16 rebuild the buffers chunk by chunk; chunks of 256 (KVCache's growth step)
    start from a view of the parent: both must give a full build's bytes."""
    root = tmp_path / "project"
    base = SYSTEM if step == STEP else " ".join([SYSTEM] * 12)  # spans whole chunks of 256
    define(root, tiny_model, system=base, prefill_step_size=step)
    old = run_build(root)
    define(root, tiny_model, version=2, system=base + MORE, prefill_step_size=step)
    new = run_build(root, check=True)
    parent = new.manifest.parent
    assert parent is not None and (parent.prefix, parent.version) == ("shop", 1)
    assert parent.folder == old.bundle.name
    assert parent.file_sha256 == old.manifest.cache.file_sha256
    assert parent.reused_tokens == new.report["reused_tokens"] > 0
    assert parent.reused_tokens % step == 0 and parent.reused_tokens < new.manifest.tokens.count
    assert new.report["reuse"].startswith(f"reused {parent.reused_tokens:,} tokens from shop@1")
    assert new.manifest.fidelity.greedy_match  # warm from the bundle equals a cold prefill
    identity = replace(model_identity(tiny_model), template=new.manifest.model.template_sha256)
    validate(new.bundle, identity, load=True)  # the one validator accepts the child
    assert_same_as_full_build(new, root, "shop", tmp_path)


def test_a_sibling_definition_sharing_the_start_is_a_parent(tmp_path: Path, tiny_model: Path):
    root = tmp_path / "project"
    define(root, tiny_model)
    run_build(root)
    define(root, tiny_model, name="shop-returns", system=SYSTEM + MORE)
    sibling = run_build(root, "shop-returns")
    assert sibling.manifest.parent is not None and sibling.manifest.parent.prefix == "shop"
    assert_same_as_full_build(sibling, root, "shop-returns", tmp_path)


def test_nothing_to_reuse_builds_from_token_zero_and_says_why(tmp_path: Path, tiny_model: Path):
    root = tmp_path / "project"
    define(root, tiny_model)
    first = run_build(root)
    assert first.manifest.parent is None and first.report["reused_tokens"] == 0
    assert (
        first.report["reuse"] == "no earlier bundle shares a whole prefill chunk with these tokens"
    )
    # a rebuild of the same bundle never starts from itself
    again = run_build(root, force=True)
    assert again.manifest.parent is None
    assert (again.bundle / MANIFEST_FILE).read_bytes() == (
        first.bundle / MANIFEST_FILE
    ).read_bytes()


def _flip_data_byte(bundle: Path) -> None:
    raw = bytearray((bundle / CACHE_FILE).read_bytes())
    raw[-100] ^= 0x01
    (bundle / CACHE_FILE).write_bytes(bytes(raw))


PARENTS = {
    # what differs in the parent -> (definition options, model fixture, edit, expected reason)
    "other weights": ({}, "tiny_model_other_weights", None, "built for other weights"),
    "quantized": (
        {"kv_bits": 8, "kv_group_size": 32},
        "tiny_model",
        None,
        "its cache is quantized (8-bit)",
    ),
    "other chunks": (
        {"prefill_step_size": 32},
        "tiny_model",
        None,
        "chunks of 32, this build uses 16",
    ),
    "tampered": ({}, "tiny_model", _flip_data_byte, "refused by the validator"),
}


@pytest.mark.parametrize("case", PARENTS)
def test_a_parent_that_cannot_give_the_same_bytes_is_refused(
    tmp_path: Path, tiny_model: Path, case: str, request
):
    options, model_fixture, edit, reason = PARENTS[case]
    parent_root = tmp_path / "parent"
    define(parent_root, request.getfixturevalue(model_fixture), **options)
    parent = run_build(parent_root).bundle
    if edit:
        edit(parent)
    root = tmp_path / "project"
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    with pytest.raises(
        BuildError, match=re.escape(f"--parent {parent}: cannot be reused ({reason}")
    ):
        run_build(root, parent=parent)
    assert not (root / "bundles" / "shop").exists()  # nothing half-written
    # looking on its own, the builder passes over it and prefills from token 0
    auto = run_build(root, bundles=parent_root / "bundles")
    assert auto.manifest.parent is None and auto.report["reused_tokens"] == 0


def test_cli_reports_the_reuse_and_full_turns_it_off(tmp_path: Path, tiny_model: Path):
    root = tmp_path / "project"
    define(root, tiny_model)
    run_build(root)
    define(root, tiny_model, version=2, system=SYSTEM + MORE)

    def cli(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, str(ROOT / "build.py"), "build", "--no-check", *args]
        return subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=300)

    full = cli("--full", "--json")
    assert full.returncode == 0, full.stderr
    assert json.loads(full.stdout)["targets"][0]["reused_tokens"] == 0
    assert "incremental builds off (--full)" in full.stderr
    inc = cli("--force", "--json")
    assert inc.returncode == 0, inc.stderr
    reused = json.loads(inc.stdout)["targets"][0]["reused_tokens"]
    assert reused > 0 and f"reused {reused:,} tokens from shop@1" in inc.stderr
    bad = cli("--parent", str(root / "nowhere"))  # checked even when up to date
    errors = [ln for ln in bad.stderr.splitlines() if ln.startswith("error:")]
    assert bad.returncode == 1 and errors == [bad.stderr.splitlines()[-1]]
    assert errors[0].startswith(f"error: --parent {root / 'nowhere'}: no such bundle folder")


def test_a_candidate_with_special_files_is_passed_over_without_reading_them(
    tmp_path: Path, tiny_model: Path
):
    """Discovery reads only regular files: a FIFO as a candidate's cache file (which would block
    an open) or a symlinked one is skipped, and the build goes on from token 0."""
    root = tmp_path / "project"
    define(root, tiny_model)
    base = run_build(root).bundle
    cache = base / CACHE_FILE
    cache.unlink()
    os.mkfifo(cache)
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    new = run_build(root)
    assert new.manifest.parent is None and new.report["reused_tokens"] == 0
    with pytest.raises(BuildError, match=r"cannot be reused \(.*not a regular file"):
        run_build(root, parent=base, force=True)
