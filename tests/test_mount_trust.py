"""Mount and serve on every path: newest version only, strict startup, symlinks, misplaced folders."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from pipeline.cli import main as cli_main
from pipeline.format.bundle_folder import CACHE_FILE, MANIFEST_FILE
from pipeline.format.errors import BundleError
from pipeline.runtime import PromptCacheManager, mount, verify

from conftest import build_bundle, write_definition

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def two_versions(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """A project with shop@1 and shop@2 built into one bundles folder; returns the project root."""
    root = tmp_path_factory.mktemp("versions")
    path = write_definition(root, tiny_model)
    build_bundle(root)
    text = path.read_text().replace("version = 1", "version = 2").replace("Be brief", "Be short")
    path.write_text(text)
    build_bundle(root)
    return root


def copy_bundles(project: Path, dest: Path) -> Path:
    shutil.copytree(project / "bundles", dest, ignore=shutil.ignore_patterns(".staging"))
    return dest


def test_mount_takes_the_newest_version_and_reports_the_older(
    two_versions: Path, tiny_model: Path, tmp_path: Path
):
    bundles = copy_bundles(two_versions, tmp_path / "bundles")
    result = mount(tiny_model, bundles, manager=PromptCacheManager())
    assert [b.name for b in result.bundles] == ["shop@2"]
    assert [p.parent.name for p in result.older] == ["1"] and result.refused == []

    pinned = mount(tiny_model, bundles, versions={"shop": 1})
    assert [b.name for b in pinned.bundles] == ["shop@1"]


def test_a_bundle_that_crashes_a_parser_is_skipped_not_fatal(
    two_versions: Path, tiny_model: Path, tmp_path: Path
):
    bundles = copy_bundles(two_versions, tmp_path / "bundles")
    (v1,) = (bundles / "shop" / "1").iterdir()
    broken = bundles / "other" / "1" / v1.name
    shutil.copytree(v1, broken)
    raw = (broken / CACHE_FILE).read_bytes()
    (broken / CACHE_FILE).write_bytes(struct.pack("<Q", 1 << 62) + raw[8:])
    result = mount(tiny_model, bundles, skip_refused=True)
    assert [b.name for b in result.bundles] == ["shop@2"]
    assert [r.path for r in result.refused] == [broken]
    with pytest.raises(BundleError):
        mount(tiny_model, bundles)


def test_a_renamed_version_folder_is_refused_everywhere(
    two_versions: Path, tiny_model: Path, tmp_path: Path
):
    bundles = copy_bundles(two_versions, tmp_path / "bundles")
    (v1,) = (bundles / "shop" / "1").iterdir()
    renamed = bundles / "shop" / "3" / v1.name
    renamed.parent.mkdir()
    v1.rename(renamed)  # a careless deploy: the old bundle now looks like the newest version
    with pytest.raises(BundleError) as info:
        verify(renamed, tiny_model)
    assert info.value.field == "location" and "shop/3/" in str(info.value)
    result = mount(tiny_model, bundles, skip_refused=True)
    assert result.bundles == [] and [r.field for r in result.refused] == ["location"]


def test_symlinked_folders_in_the_bundles_tree_are_reported_never_followed(
    two_versions: Path, tiny_model: Path, tmp_path: Path
):
    outside = copy_bundles(two_versions, tmp_path / "elsewhere")
    bundles = tmp_path / "bundles"
    (bundles / "shop").mkdir(parents=True)
    (bundles / "shop" / "2").symlink_to(outside / "shop" / "2")  # target outside the root
    result = mount(tiny_model, bundles, skip_refused=True)
    assert result.bundles == []
    assert len(result.refused) == 1 and "links are not followed" in result.refused[0].reason

    inside = tmp_path / "bundles" / "store"  # inside the root, but not in the layout either
    shutil.copytree(outside / "shop" / "2", inside / "shop-2")
    (bundles / "shop" / "2").unlink()
    (bundles / "shop" / "2").symlink_to(inside / "shop-2")
    result = mount(tiny_model, bundles, skip_refused=True)
    assert result.bundles == []
    assert [(r.path, r.field) for r in result.refused] == [
        (bundles / "shop" / "2", "layout"),
        (inside / "shop-2", "layout"),
    ]


def test_serve_strict_refuses_a_missing_or_empty_bundles_folder(
    tiny_model: Path, tmp_path: Path, capsys
):
    assert (
        cli_main(
            ["serve", "--model", str(tiny_model), "--bundles", str(tmp_path / "nope"), "--strict"]
        )
        == 1
    )
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: bundle ") and "does not exist" in err[0]
    (tmp_path / "empty").mkdir()
    assert (
        cli_main(
            ["serve", "--model", str(tiny_model), "--bundles", str(tmp_path / "empty"), "--strict"]
        )
        == 1
    )
    assert "no bundle for" in capsys.readouterr().err


def test_serve_strict_refuses_when_any_bundle_is_refused(
    shop_bundle: Path, tiny_model_other_weights: Path, capsys
):
    code = cli_main(
        [
            "serve",
            "--model",
            str(tiny_model_other_weights),
            "--bundles",
            str(shop_bundle.parents[2]),
            "--strict",
        ]
    )
    assert code == 1 and "model weights/config mismatch" in capsys.readouterr().err


def test_verify_full_rehashes_what_the_memo_knows(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path, monkeypatch
):
    from pipeline.format import memo

    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "memo"))
    bundle = shutil.copytree(shop_bundle, tmp_path / "b")
    mount(tiny_model, bundle)
    calls = []
    real = memo.lookup
    monkeypatch.setattr(memo, "lookup", lambda key: calls.append(key) or real(key))
    mount(tiny_model, bundle, verify_full=True)
    assert not any(CACHE_FILE in key for key in calls)  # the cache file's memo was not consulted


def test_manifest_records_the_cache_file_digest_and_size(shop_bundle: Path):
    from pipeline.format.fingerprint import sha256_file

    cache = json.loads((shop_bundle / MANIFEST_FILE).read_text())["cache"]
    assert cache["file_sha256"] == sha256_file(shop_bundle / CACHE_FILE)
    assert cache["file_bytes"] == (shop_bundle / CACHE_FILE).stat().st_size


def test_a_folder_of_special_files_and_a_broken_symlink_are_reported_not_skipped(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path
):
    import os

    bundles = tmp_path / "bundles"
    fifo_bundle = bundles / "shop" / "1" / shop_bundle.name
    fifo_bundle.mkdir(parents=True)
    os.mkfifo(fifo_bundle / MANIFEST_FILE)
    (bundles / "gone").symlink_to(tmp_path / "nowhere")
    result = mount(tiny_model, bundles, skip_refused=True)
    reasons = sorted(r.reason for r in result.refused)
    assert result.bundles == [] and len(reasons) == 2
    assert reasons[0] == "broken symlink; not followed" and "is a FIFO" in reasons[1]


def test_a_lockfile_pin_the_deploy_lacks_is_refused_not_served_cold(
    two_versions: Path, tiny_model: Path, tiny_model_other_weights: Path, tmp_path: Path, capsys
):
    """The lockfile pins shop@3 for this model; only shop@1 and @2 are deployed: a refusal
    naming the pin (serve --strict stops), not a prefix silently left cold (before: nothing
    said, --strict started). A pin for another model is not this deploy's to hold."""
    from pipeline.format.fingerprint import model_fingerprint
    from pipeline.format.lockfile import LockedPrefix, Lockfile, locked_for_model, write_lock

    bundles = copy_bundles(two_versions, tmp_path / "bundles")
    fingerprint = model_fingerprint(tiny_model)
    (folder,) = (p.name for p in (bundles / "shop" / "2").iterdir())
    entry = LockedPrefix(
        version=3, content_sha256="0" * 64, template_sha256="0" * 64, models={folder: fingerprint}
    )
    path = tmp_path / "prefixes.lock"
    write_lock(path, Lockfile(prefixes={"shop": entry}))
    assert locked_for_model(path, fingerprint) == {"shop": 3}
    assert locked_for_model(path, model_fingerprint(tiny_model_other_weights)) == {}

    result = mount(
        tiny_model, bundles, skip_refused=True, versions={"shop": 3}, required={"shop": 3}
    )
    assert result.bundles == [] and [(r.path, r.field) for r in result.refused] == [
        (bundles / "shop" / "3", "lockfile")
    ]
    argv = ["serve", "--model", str(tiny_model), "--bundles", str(bundles), "--strict"]
    port = str(__import__("servers_env").free_port())  # tests run in parallel: never a fixed port
    assert cli_main([*argv, "--lockfile", str(path), "--port", port]) == 1
    err = capsys.readouterr().err
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(
            f"error: bundle {bundles / 'shop' / '3'}: the lockfile pins shop@3 for this model, but "
            f"no bundle of it is in {bundles}"
        )
    ), err


@pytest.mark.parametrize(
    ("args", "kwargs", "said"),
    [
        ((None,), {}, "model_dir must be a path (str or Path), got NoneType"),
        (("m", 3), {}, "bundles must be a path (str or Path), got int"),
        (("m", ("a", "b")), {}, "bundles must be a path (str or Path), got tuple"),
        (("m",), {"versions": {"shop": "1"}}, "versions must map prefix names to version numbers"),
        (("m",), {"versions": ["shop"]}, "versions must map prefix names to version numbers"),
        (("m",), {"manager": {}}, "manager must be a PromptCacheManager, got dict"),
    ],
    ids=["no model", "a number", "a tuple", "a version as text", "a list", "a dict manager"],
)
def test_mount_names_an_argument_of_the_wrong_kind(args, kwargs, said):
    """A caller's mistake is one PipelineError naming the argument (before: TypeError or
    AttributeError from deep inside; versions={"shop": "1"} mounted nothing and said nothing)."""
    import re

    from pipeline.format.errors import PipelineError

    with pytest.raises(PipelineError, match=re.escape(said)):
        mount(*args, **kwargs)


def test_the_runtime_calls_name_an_argument_that_is_not_a_path():
    import re

    from pipeline.format.errors import PipelineError
    from pipeline.runtime import find_bundles, identity_for

    for call, args, said in [
        (verify, (None, "m"), "verify: bundle must be a path (str or Path), got NoneType"),
        (verify, ("b", 3), "verify: model_dir must be a path (str or Path), got int"),
        (identity_for, (None,), "identity_for: model_dir must be a path (str or Path)"),
        (identity_for, ("m", 3), "identity_for: chat_template must be text, got int"),
        (find_bundles, (None,), "find_bundles: root must be a path (str or Path), got NoneType"),
    ]:
        with pytest.raises(PipelineError, match=re.escape(said)):
            call(*args)


def test_a_bundles_path_that_is_a_file_is_said_to_be_one(tiny_model: Path, tmp_path: Path):
    (tmp_path / "bundles").write_text("not a folder")
    with pytest.raises(BundleError, match="bundles folder is not a folder"):
        mount(tiny_model, tmp_path / "bundles")
