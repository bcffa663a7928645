"""A lockfile pins exactly the folders it names (issue 48, finding 1): a relabeled sibling of a
pinned bundle (same prefix, version and model fingerprint, another slug) is never pulled with it,
and mount/remount never let two folders of one NAME@VERSION and model shadow each other: the
lockfile's folder is chosen, else both are refused in one line naming both."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fuzz_corpus import reseal_sums
from registry_env import registry
from test_distribute import fake_hub  # noqa: F401 - the fixture, used below
from test_oci import no_docker_config  # noqa: F401 - autouse: no credentials of this machine

from pipeline.cli import main
from pipeline.cli.reports import PullReport, PushReport
from pipeline.format.bundle_folder import FINGERPRINT_CHARS, MANIFEST_FILE
from pipeline.format.lockfile import locked_folders, locked_versions
from pipeline.runtime import mount
from pipeline.runtime.prompt_cache import PromptCacheManager
from pipeline.runtime.remount import Remounter

from conftest import document


@pytest.fixture
def model(tmp_path: Path, tiny_model: Path) -> Path:
    """A deployable copy of the tiny model (pull writes into <model>/prefix-bundles)."""
    return Path(shutil.copytree(tiny_model, tmp_path / "deploy" / "tiny"))


def relabeled(bundle: Path, root: Path, slug: str = "zz") -> Path:
    """A copy of bundle at <root>/<name>/<version>/<slug>-<same fp12>, its manifest's slug edited
    and SHA256SUMS recomputed: valid, unsigned, the same NAME@VERSION for the same model."""
    folder = f"{slug}-{bundle.name[-FINGERPRINT_CHARS:]}"
    dest = root / bundle.parent.parent.name / bundle.parent.name / folder
    shutil.copytree(bundle, dest)
    m = json.loads((dest / MANIFEST_FILE).read_text())
    m["model"]["slug"] = slug
    (dest / MANIFEST_FILE).write_text(json.dumps(m, sort_keys=True, indent=2) + "\n")
    reseal_sums(dest)
    return dest


def in_layout(bundle: Path, root: Path) -> Path:
    dest = root / bundle.parent.parent.name / bundle.parent.name / bundle.name
    shutil.copytree(bundle, dest)
    return dest


def write_lockfile(path: Path, bundle: Path, digest: str | None = None) -> Path:
    """A prefixes.lock naming bundle's folder (and its artifact digest, when given)."""
    m = json.loads((bundle / MANIFEST_FILE).read_text())
    entry = {"version": m["prefix"]["version"], "content_sha256": m["prefix"]["content_sha256"],
             "template_sha256": m["model"]["template_sha256"],
             "models": {bundle.name: m["model"]["fingerprint"]}}  # fmt: skip
    if digest:
        entry["artifacts"] = {bundle.name: digest}
    path.write_text(json.dumps({"lock_version": 1, "prefixes": {m["prefix"]["name"]: entry}}))
    return path


def published(model: Path) -> list[str]:
    root = model / "prefix-bundles"
    return sorted(str(p.relative_to(root)) for p in root.glob("[!.]*/*/*")) if root.exists() else []


# --- pull ---------------------------------------------------------------------------------------


def test_oci_pull_lockfile_takes_only_the_named_folder_not_a_relabeled_sibling(
    tmp_path: Path, shop_bundle: Path, model: Path, capsys
):
    sibling = relabeled(shop_bundle, tmp_path / "forged")
    lockfile = write_lockfile(tmp_path / "prefixes.lock", shop_bundle)
    with registry(tmp_path / "registry") as reg:
        push = ["push", str(shop_bundle), "--repo", reg.repo(), "--lockfile", str(lockfile)]
        assert main([*push, "--json"]) == 0
        digest = document(PushReport, capsys.readouterr().out).bundles[0].digest
        assert main(["push", str(sibling), "--repo", reg.repo()]) == 0  # beside it, by tag
        capsys.readouterr()

        pull = ["pull", "--repo", reg.repo(), "--model", str(model), "--lockfile", str(lockfile)]
        assert main([*pull, "--json"]) == 0
        report = document(PullReport, capsys.readouterr().out)
    assert published(model) == [f"shop/1/{shop_bundle.name}"]
    rows = {b.repo_path: b for b in report.bundles}
    assert (rows[f"shop/1/{shop_bundle.name}"].status, rows[f"shop/1/{shop_bundle.name}"].digest) == ("pulled", digest)  # fmt: skip
    row = rows[f"shop/1/{sibling.name}"]
    assert (row.status, row.reason) == (
        "skipped",
        "not named by the lockfile (it pins exactly the folders it names)",
    )


def test_oci_pull_lockfile_entry_without_a_digest_is_by_tag_and_says_so(
    reg_folder: Path, shop_bundle: Path, model: Path, tmp_path: Path, capsys
):
    sibling = relabeled(shop_bundle, tmp_path / "forged")
    lockfile = write_lockfile(tmp_path / "prefixes.lock", shop_bundle)  # no artifact digest
    with registry(reg_folder) as reg:
        for b in (shop_bundle, sibling):
            assert main(["push", str(b), "--repo", reg.repo()]) == 0
        capsys.readouterr()
        pull = ["pull", "--repo", reg.repo(), "--model", str(model), "--lockfile", str(lockfile)]
        assert main(pull) == 0
        out = capsys.readouterr().out.splitlines()
    dest = model / "prefix-bundles" / "shop" / "1" / shop_bundle.name
    pulled = [line for line in out if line.startswith("pulled ")]
    assert len(pulled) == 1 and pulled[0].endswith(
        f" by tag: the lockfile records no digest for it (push --lockfile records one) -> {dest}"
    )
    assert f"skipped shop/1/{sibling.name}: not named by the lockfile (it pins exactly the folders it names)" in out  # fmt: skip
    assert published(model) == [f"shop/1/{shop_bundle.name}"]


@pytest.fixture
def reg_folder(tmp_path: Path) -> Path:
    return tmp_path / "registry"


def test_oci_pull_lockfile_folder_absent_from_the_registry_is_one_line(
    reg_folder: Path, shop_bundle: Path, model: Path, tmp_path: Path, capsys
):
    """Only the sibling is there: the lockfile's folder is missing, the sibling is not taken."""
    sibling = relabeled(shop_bundle, tmp_path / "forged")
    lockfile = write_lockfile(tmp_path / "prefixes.lock", shop_bundle)
    with registry(reg_folder) as reg:
        assert main(["push", str(sibling), "--repo", reg.repo()]) == 0
        capsys.readouterr()
        pull = ["pull", "--repo", reg.repo(), "--model", str(model), "--lockfile", str(lockfile)]
        assert main(pull) == 1
        fp = shop_bundle.name[-FINGERPRINT_CHARS:]
        assert capsys.readouterr().err == (
            f"error: registry repo oci://{reg.host}/fleet/bundles: no bundle shop/1/{shop_bundle.name}, "
            f"which the lockfile pins for this model (fingerprint {fp}); push it ('prefix-bundles "
            "push ... --lockfile'), or pull with the lockfile of what was pushed: "
            "nothing was published\n"
        )
    assert published(model) == []


@pytest.mark.usefixtures("fake_hub")
def test_hub_pull_lockfile_takes_only_the_named_folder(
    tmp_path: Path, shop_bundle: Path, model: Path, capsys
):
    sibling = relabeled(shop_bundle, tmp_path / "forged")
    lockfile = write_lockfile(tmp_path / "prefixes.lock", shop_bundle)
    assert main(["push", str(shop_bundle), str(sibling), "--repo", "acme/prefix-bundles"]) == 0
    capsys.readouterr()
    pull = [
        "pull",
        "--repo",
        "acme/prefix-bundles",
        "--model",
        str(model),
        "--lockfile",
        str(lockfile),
    ]
    assert main(pull) == 0
    out = capsys.readouterr().out
    assert published(model) == [f"shop/1/{shop_bundle.name}"]
    assert f"skipped shop/1/{sibling.name}: not named by the lockfile" in out


# --- mount, remount -----------------------------------------------------------------------------


def test_mount_refuses_both_folders_of_one_version_and_model_in_one_line(
    tmp_path: Path, shop_bundle: Path, tiny_model: Path
):
    root = tmp_path / "bundles"
    real = in_layout(shop_bundle, root)
    sibling = relabeled(shop_bundle, root)
    result = mount(tiny_model, root, skip_refused=True)
    assert result.bundles == []
    both = f"{sorted([real, sibling])[0]} and {sorted([real, sibling])[1]}"
    why = (
        f"shop@1 is in 2 folders for one model ({both}); none is mounted (one would shadow the "
        "other): remove the one not deployed, or serve with --lockfile naming one"
    )
    assert sorted((r.path, r.reason) for r in result.refused) == sorted(
        [(real, why), (sibling, why)]
    )
    with pytest.raises(Exception) as raised:  # without skip_refused: the same line, raised
        mount(tiny_model, root)
    assert raised.value.reason == why


def test_mount_with_the_lockfile_takes_the_folder_it_names(
    tmp_path: Path, shop_bundle: Path, tiny_model: Path
):
    root = tmp_path / "bundles"
    real = in_layout(shop_bundle, root)
    sibling = relabeled(shop_bundle, root)
    lockfile = write_lockfile(tmp_path / "prefixes.lock", shop_bundle)
    manager = PromptCacheManager()
    pins = {"versions": locked_versions(lockfile), "folders": locked_folders(lockfile)}
    result = mount(tiny_model, root, skip_refused=True, manager=manager, **pins)
    assert [b.path for b in result.bundles] == [real]
    ((path, reason),) = [(r.path, r.reason) for r in result.refused]
    assert (path, reason) == (
        sibling,
        f"the lockfile pins shop@1 for this model in {real.name}, not in {sibling.name}; not "
        "mounted (it would shadow the pinned one): remove it, or lock what is deployed",
    )
    # bundles given as folders: the same rule, by manifest
    listed = mount(tiny_model, [sibling, real], skip_refused=True, **pins)
    assert [b.path for b in listed.bundles] == [real]
    assert [r.path for r in listed.refused] == [sibling]


def test_remount_never_lets_a_sibling_shadow_the_mounted_folder(
    tmp_path: Path, shop_bundle: Path, tiny_model: Path
):
    root = tmp_path / "bundles"
    real = in_layout(shop_bundle, root)
    manager = PromptCacheManager()
    first = mount(tiny_model, root, skip_refused=True, manager=manager, model_key="m")
    r = Remounter(first, manager, "m", lambda: mount(tiny_model, root, skip_refused=True))
    sibling = relabeled(shop_bundle, root)  # appears while serving
    changes = r.remount()
    assert [b.path for b in r.current.values()] == [real]
    assert sorted(x.path for x in changes.refused) == sorted([real, sibling])
    assert changes.serving == [("shop@1", "its new version was refused or is not usable")]
    lockfile = write_lockfile(tmp_path / "prefixes.lock", shop_bundle)
    pins = {"versions": locked_versions(lockfile), "folders": locked_folders(lockfile)}
    r.load = lambda: mount(tiny_model, root, skip_refused=True, **pins)
    changes = r.remount()
    assert [b.path for b in r.current.values()] == [real]
    assert [x.path for x in changes.refused] == [sibling]
