"""A parent is reused only for what its bytes were built for (issue 36): the build record pins the
parent's manifest, the builder's kernels are part of its identity, and the manifest's format 3
carries both; format 2 bundles still mount but are never continued."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_incremental import MORE, define, run_build

from pipeline.builder.kernels import kernels
from pipeline.format.bundle_folder import CACHE_FILE, MANIFEST_FILE, SUMS_FILE
from pipeline.format.errors import BuildError, BundleError
from pipeline.format.fingerprint import model_identity, sha256_file
from pipeline.format.validate import validate
from pipeline.runtime import mount

from conftest import SYSTEM

ROOT = Path(__file__).resolve().parent.parent


def resum(bundle: Path) -> None:
    """Regenerate SHA256SUMS, as a careless or hostile copy would."""
    (bundle / SUMS_FILE).write_text(
        "".join(f"{sha256_file(bundle / n)}  {n}\n" for n in (CACHE_FILE, MANIFEST_FILE))
    )


def rewrite(bundle: Path, change) -> None:
    raw = json.loads((bundle / MANIFEST_FILE).read_text())
    change(raw)
    (bundle / MANIFEST_FILE).write_text(json.dumps(raw, sort_keys=True, indent=2) + "\n")
    resum(bundle)


def test_a_parent_relabeled_as_another_models_is_not_vouched_for(
    tmp_path: Path, tiny_model: Path, tiny_model_other_weights: Path, monkeypatch
):
    """Model A's bundle copied into model B's folder with B's fingerprint passes the validator for
    B (integrity is not authenticity), but the build record never vouches for it: B's child is
    prefilled from token 0."""
    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "memo"))
    root = tmp_path / "project"
    define(root, tiny_model)
    a = run_build(root)
    define(root, tiny_model_other_weights)
    b_place = run_build(root, bundles=tmp_path / "scratch").bundle  # where B's v1 would live
    fake = root / "bundles" / b_place.relative_to(tmp_path / "scratch")
    shutil.copytree(a.bundle, fake)
    b = model_identity(tiny_model_other_weights)

    def relabel(raw: dict) -> None:
        raw["model"]["fingerprint"] = b.model
        raw["model"]["slug"] = fake.name.rsplit("-", 1)[0]

    rewrite(fake, relabel)
    validate(fake, b, load=True)  # the relabeled copy is internally consistent
    define(root, tiny_model_other_weights, version=2, system=SYSTEM + MORE)
    child = run_build(root)
    assert child.manifest.parent is None and child.report["reused_tokens"] == 0
    assert "neither signed by a --trusted-key nor built by this builder" in child.report["reuse"]


def test_a_parent_from_other_kernels_is_not_continued_and_says_why(
    tmp_path: Path, tiny_model: Path, monkeypatch
):
    """A parent whose builder.kernels differ from this build's (here: relabeled by hand, as a
    different BLAS would record) is passed over with one line naming both."""
    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "memo"))
    root = tmp_path / "project"
    define(root, tiny_model)
    parent = run_build(root).bundle
    rewrite(parent, lambda raw: raw["builder"].update(kernels="cpu x86_64; blas other"))
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    child = run_build(root, parent_check="chunks")
    assert child.manifest.parent is None and child.report["reused_tokens"] == 0
    why = child.report["reuse"]
    assert why.startswith(
        f"prefilled from token 0; refused as a parent: {parent}: made by other kernels"
    )
    assert "blas other" in why and kernels() in why


def test_builds_with_and_without_openblas_record_different_kernels(
    tmp_path: Path, tiny_model: Path
):
    """The same definition built with OpenBLAS and with mlx-cpu's own BLAS: different builder
    identities (and build keys), and the child built without OpenBLAS does not continue the
    parent built with it."""
    root = tmp_path / "project"
    define(root, tiny_model)
    env = {**os.environ, "PREFIX_BUNDLES_CACHE_DIR": str(tmp_path / "memo")}

    def cli(*args: str, off: bool = False) -> subprocess.CompletedProcess:
        extra = {"PREFIX_BUNDLES_OPENBLAS": "off"} if off else {}
        return subprocess.run(
            [sys.executable, str(ROOT / "build.py"), "--prefixes", str(root / "prefixes"),
             "--bundles", str(root / "bundles"), *args],
            env={**env, **extra}, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip

    on = cli("build", "--no-check", "--json")
    assert on.returncode == 0, on.stderr
    bundle = next((root / "bundles" / "shop" / "1").iterdir())
    with_blas = json.loads((bundle / MANIFEST_FILE).read_text())
    assert "OpenBLAS" in with_blas["builder"]["kernels"]
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    off = cli("build", "--no-check", off=True)
    assert off.returncode == 0, off.stderr
    child_dir = next((root / "bundles" / "shop" / "2").iterdir())
    child = json.loads((child_dir / MANIFEST_FILE).read_text())
    assert "no system OpenBLAS loaded" in child["builder"]["kernels"]
    assert child["builder"]["kernels"] != with_blas["builder"]["kernels"]
    assert "parent" not in child  # not continued from the other kernels' bytes
    assert "made by other kernels" in off.stdout + off.stderr


@pytest.fixture
def format2_bundle(tmp_path: Path, shop_bundle: Path) -> Path:
    """The shop bundle as a format-2 builder wrote it (no kind, no builder.kernels, no
    cache.blocks)."""
    bundle = shutil.copytree(shop_bundle, tmp_path / "b")

    def older(raw: dict) -> None:
        raw["format_version"] = 2
        raw.pop("kind")
        raw["builder"].pop("kernels")
        raw["cache"].pop("blocks")

    rewrite(bundle, older)
    return bundle


def test_a_format_2_bundle_still_mounts(format2_bundle: Path, tiny_model: Path):
    (mounted,) = mount(tiny_model, format2_bundle).bundles
    assert mounted.manifest.format_version == 2


def test_a_format_2_parent_is_recomputed_once_and_says_so(format2_bundle: Path, tiny_model: Path):
    from pipeline.builder.incremental import Wanted, examine
    from pipeline.format.manifest import BuilderInfo

    builder = BuilderInfo(
        pipeline="x", mlx="0", mlx_lm="0", platform="p", device="d", compute_dtype="float32",
        kernels=kernels(),
    )  # fmt: skip
    manifest, why = examine(
        format2_bundle, Wanted([], model_identity(tiny_model), builder, "float32", 2048)
    )
    assert manifest is None
    assert why.startswith("format 2: it does not record which kernels made it")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda raw: raw["builder"].pop("kernels"), "format_version 3 requires builder.kernels"),
        (lambda raw: raw.pop("kind"), "format_version 3 requires kind"),
        (
            lambda raw: raw.update(format_version=2),
            "kind and builder.kernels are format 3 fields",
        ),
    ],
)
def test_a_manifest_missing_its_formats_fields_is_refused(
    tmp_path: Path, shop_bundle: Path, tiny_model: Path, change, reason: str
):
    bundle = shutil.copytree(shop_bundle, tmp_path / "b")
    rewrite(bundle, change)
    with pytest.raises(BundleError) as info:
        mount(tiny_model, bundle)
    assert reason in info.value.reason


def test_a_newer_format_names_the_release_to_upgrade_to(
    tmp_path: Path, shop_bundle: Path, tiny_model: Path
):
    bundle = shutil.copytree(shop_bundle, tmp_path / "b")

    def newer(raw: dict) -> None:
        raw["format_version"] = 6  # 4 is a snapshot's (SNAPSHOT_FORMAT), 5 this one's
        raw["builder"]["pipeline"] = "0.9.0"

    rewrite(bundle, newer)
    with pytest.raises(BundleError) as info:
        mount(tiny_model, bundle)
    assert info.value.field == "format_version"
    assert info.value.reason == (
        "format_version 6 is newer than this runtime reads (2, 3, 4, 5); upgrade the runtime to "
        "mlx-prefix-bundles 0.9.0 or later"
    )


def test_kernels_name_the_device_the_mlx_build_and_the_blas():
    line = kernels()
    assert line.startswith(("cpu ", "gpu "))
    assert "mlx " in line and "libmlx " in line and "; blas " in line
    assert "OpenBLAS" in line  # conftest loads it before mlx


def test_a_bundle_is_not_its_own_parent(tmp_path: Path, tiny_model: Path):
    """--parent naming the bundle the build writes (a forced rebuild) is refused: its manifest
    would name itself as parent, pinning a digest that the build replaces."""
    root = tmp_path / "project"
    define(root, tiny_model)
    old = run_build(root)
    with pytest.raises(BuildError, match=r"that is the bundle this build writes"):
        run_build(root, force=True, parent=old.bundle)
    os.symlink(old.bundle, root / "link-to-it")
    with pytest.raises(BuildError, match=r"that is the bundle this build writes"):
        run_build(root, force=True, parent=root / "link-to-it")


def test_a_parent_passed_through_a_link_is_recorded_by_its_own_folder(
    tmp_path: Path, tiny_model: Path
):
    """The manifest records the parent's real folder, where a later step (signing) finds it."""
    root = tmp_path / "project"
    define(root, tiny_model)
    old = run_build(root)
    os.symlink(old.bundle, tmp_path / "parentlink")
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    child = run_build(root, parent=tmp_path / "parentlink")
    assert child.manifest.parent.folder == old.bundle.name


def test_a_private_cache_folder_reached_through_a_link_keeps_the_build_record(
    tmp_path: Path, tiny_model: Path, monkeypatch
):
    """PREFIX_BUNDLES_CACHE_DIR may be a link to this user's private folder: the record is read
    and written there (it was ignored without a word, so every parent was refused)."""
    (tmp_path / "real").mkdir(mode=0o700)
    os.symlink(tmp_path / "real", tmp_path / "cachelink")
    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "cachelink"))
    root = tmp_path / "project"
    define(root, tiny_model)
    run_build(root)
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    child = run_build(root)
    assert child.manifest.parent is not None
    assert child.manifest.parent.checked.startswith("built by this builder")
    assert (tmp_path / "real" / "built-caches.json").is_file()


def test_a_copy_of_the_bundle_this_build_writes_is_not_its_parent(tmp_path: Path, tiny_model: Path):
    """A copy of the destination (same prefix, version and weights) is refused as --parent: the
    child would record itself as its own parent and reuse all of its own tokens."""
    root = tmp_path / "project"
    define(root, tiny_model)
    run_build(root)
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    dest = run_build(root).bundle
    shutil.copytree(dest, tmp_path / "copy")
    with pytest.raises(BuildError) as caught:
        run_build(root, force=True, parent=tmp_path / "copy")
    assert str(caught.value) == (
        f"--parent {tmp_path / 'copy'}: cannot be reused (it is shop@2 for these weights: the "
        "bundle this build writes, or a copy of it); pass another bundle or drop --parent to "
        "build from token 0"
    )


def as_snapshot(bundle: Path) -> None:
    """Make a bundle's manifest a schema-valid runtime snapshot's (as serve --snapshots writes)."""

    def change(raw: dict) -> None:
        for key in ("prefix", "text", "request", "parent"):
            raw.pop(key, None)
        raw["kind"] = "snapshot"
        raw["snapshot"] = {"server": "mlx-lm", "source": "prompt cache", "lossy": False, "rank": 0}
        raw["format_version"] = 3  # a snapshot's before depends_on (cache.blocks is format 5's)
        raw["cache"].pop("blocks", None)

    rewrite(bundle, change)


def test_a_snapshot_in_the_bundles_tree_is_no_parent_and_no_build(
    tmp_path: Path, tiny_model: Path, capsys
):
    """A runtime snapshot where a build looks for parents is passed over with its reason, and
    one where a build writes is that definition's one error line: the others are built."""
    from pipeline.cli import main

    root = tmp_path / "project"
    define(root, tiny_model)
    snapshot = run_build(root).bundle
    as_snapshot(snapshot)
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    with pytest.raises(BuildError, match=r"cannot be reused \(it is a runtime snapshot \(kind "):
        run_build(root, parent=snapshot)
    child = run_build(root)
    assert child.manifest.parent is None
    assert (
        f'{snapshot}: it is a runtime snapshot (kind "snapshot"), not a prefix bundle'
        in (child.report["reuse"])
    )
    define(root, tiny_model, version=1)  # shop@1 again: its folder holds the snapshot
    define(root, tiny_model, name="zz-other", system=SYSTEM + MORE)
    argv = ["--prefixes", str(root / "prefixes"), "--bundles", str(root / "bundles")]
    assert main([*argv, "build", "--no-check", "--force"]) == 1
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert errors == [
        f'error: shop@1 -> tiny: {snapshot}: holds a runtime snapshot (kind "snapshot"), not a '
        "prefix bundle, where this build writes; move it out of the bundles folder (serve "
        "--snapshots keeps its own folder) and build again",
        "error: 1 of 2 definitions failed (shop); the others were built: fix the errors above "
        "and build again",
    ]
    assert len(list((root / "bundles" / "zz-other" / "1").iterdir())) == 1


def test_a_parent_folder_swapped_after_its_facts_were_read_is_judged_again(
    tmp_path: Path, tiny_model: Path, monkeypatch
):
    """The builder reads a parent's manifest to judge its facts (quantization, kernels, dtype),
    then validates a fresh read: a folder swapped in between (a bundles-tree writer racing the
    build) is judged again on what the validator read, never continued unchecked."""
    from pipeline.builder import incremental

    root = tmp_path / "project"
    define(root, tiny_model)
    full = run_build(root)
    define(root, tiny_model, name="q", kv_bits=8)
    quantized = run_build(root, "q")
    real = incremental.examine  # the first read sees the full-precision bundle's manifest
    monkeypatch.setattr(incremental, "examine", lambda bundle, wanted: real(full.bundle, wanted))
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    with pytest.raises(BuildError, match=r"cannot be reused \(its cache is quantized \(8-bit\)"):
        run_build(root, parent=quantized.bundle)
