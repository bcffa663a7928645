"""No command deletes or renames through a link out of the bundles tree (issue 16, finding 4).

A bundles folder whose `.staging`, prefix or version folder is a symlink to a folder outside:
`build`, `prune --apply` and `pull` (tests/test_distribute.py) refuse with one `error:` line, and
the link's target is left byte for byte as it was. A folder swapped for a link after prune planned
its deletion is refused too (each step walks from the root without following links).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.builder import retention
from pipeline.cli import main
from pipeline.format.errors import PipelineError
from pipeline.format.safe_tree import make_folders, remove_tree, rename

from conftest import build_bundle, write_definition


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          check=True, capture_output=True, text=True)  # fmt: skip
    return int(done.stdout)


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


def cli(project: Path, *argv: str) -> int:
    return main(
        ["--prefixes", str(project / "prefixes"), "--bundles", str(project / "bundles"), *argv]
    )


def link_away(folder: Path, outside: Path) -> None:
    """Move folder to `outside` and leave a symlink to it in its place."""
    outside.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(folder), str(outside))
    folder.symlink_to(outside, target_is_directory=True)


@pytest.fixture
def built(project: Path) -> Path:
    """shop@1 built into project/bundles, then the definition moved to version 2."""
    bundle = build_bundle(project)
    toml = project / "prefixes" / "shop.toml"
    toml.write_text(toml.read_text().replace("version = 1", "version = 2"))
    return bundle


def outside_with_dead_staging(tmp_path: Path) -> Path:
    """What a `.staging` link points at: folders named like a dead build's, and locks."""
    outside = tmp_path / "elsewhere"
    for name in (f"{dead_pid()}-precious", "locks"):
        (outside / name).mkdir(parents=True)
        (outside / name / "data").write_text("not the bundles tree's\n")
    return outside


@pytest.mark.parametrize("command", [["build", "--no-check"], ["prune", "--apply"]])
def test_a_linked_staging_folder_is_refused_and_its_target_untouched(
    project: Path, built: Path, tmp_path: Path, command: list[str], capsys
):
    staging = project / "bundles" / ".staging"
    shutil.rmtree(staging)
    outside = outside_with_dead_staging(tmp_path)
    staging.symlink_to(outside, target_is_directory=True)
    before = snapshot(outside)
    capsys.readouterr()
    assert cli(project, *command) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == (
        f"error: {staging} is a symlink ({outside}); nothing under the bundles folder "
        f"{project / 'bundles'} is created, renamed or deleted through a link: replace it with "
        "a real folder"
    )
    assert snapshot(outside) == before
    assert not (project / "bundles" / "shop" / "2").exists()


@pytest.mark.parametrize("linked", ["prefix", "version"])
def test_a_build_never_publishes_through_a_linked_prefix_or_version_folder(
    project: Path, built: Path, tmp_path: Path, linked: str, capsys
):
    """Rebuilding shop@1 where bundles/shop (or bundles/shop/1) is a link: the old bundle at the
    link's target would be swapped out and deleted; the build refuses instead."""
    toml = project / "prefixes" / "shop.toml"
    toml.write_text(toml.read_text().replace("version = 2", "version = 1"))
    folder = built.parent.parent if linked == "prefix" else built.parent
    outside = tmp_path / "elsewhere" / linked
    link_away(folder, outside)
    before = snapshot(outside)
    capsys.readouterr()
    assert cli(project, "build", "--no-check", "--force") == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(f"error: {folder} is a symlink ({outside}); nothing under the")
    assert snapshot(outside) == before
    assert [p.name for p in (project / "bundles" / ".staging").iterdir()] == ["locks"]


@pytest.mark.parametrize("linked", ["prefix", "version", "bundle"])
def test_prune_refuses_a_folder_swapped_for_a_link_after_planning(
    project: Path, built: Path, tmp_path: Path, linked: str
):
    """Planned: shop@1 (older than shop@2). Then its prefix, version or bundle folder becomes a
    link to a copy outside: the delete is refused and the copy stays whole."""
    build_bundle(project)  # shop@2
    (planned,) = retention.plan(project / "bundles", project / "prefixes").delete
    assert planned.path == built
    folder = {"prefix": built.parent.parent, "version": built.parent, "bundle": built}[linked]
    outside = tmp_path / "elsewhere" / linked
    link_away(folder, outside)
    before = snapshot(outside)
    with pytest.raises(PipelineError, match="is a symlink"):
        retention.delete(planned, project / "bundles")
    assert snapshot(outside) == before and folder.is_symlink()


def test_tree_operations_refuse_paths_outside_the_root(tmp_path: Path):
    root, other = tmp_path / "bundles", tmp_path / "other"
    (other / "x").mkdir(parents=True)
    make_folders(root, root / "a" / "b")
    for call in (
        lambda: remove_tree(root, other / "x"),
        lambda: remove_tree(root, root / ".." / "other" / "x"),
        lambda: rename(root, root / "a", other / "y"),
        lambda: make_folders(root, root),
    ):
        with pytest.raises(PipelineError, match="is not inside the bundles folder"):
            call()
    assert (other / "x").is_dir() and (root / "a" / "b").is_dir()


def test_a_second_definition_does_not_change_the_refusal(project: Path, tiny_model: Path):
    """A link anywhere on the way is found, not only the first component."""
    write_definition(project, tiny_model, name="faq")
    root = project / "bundles"
    make_folders(root, root / "faq" / "1")
    (root / "faq" / "1" / "m").symlink_to(project, target_is_directory=True)
    with pytest.raises(PipelineError, match=r"faq/1/m is a symlink"):
        make_folders(root, root / "faq" / "1" / "m" / "x")
    with pytest.raises(PipelineError, match=r"faq/1/m is a symlink"):
        remove_tree(root, root / "faq" / "1" / "m")
    assert (project / "prefixes" / "faq.toml").is_file()


def test_a_link_inside_a_removed_folder_is_unlinked_not_followed(tmp_path: Path):
    root, outside = tmp_path / "bundles", tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "deep" / "keep").write_text("not ours\n")
    doomed = root / ".staging" / "123-x"
    make_folders(root, doomed / "sub")
    (doomed / "sub" / "to-outside").symlink_to(outside, target_is_directory=True)
    (doomed / "file-link").symlink_to(outside / "deep" / "keep")
    remove_tree(root, doomed)
    assert not doomed.exists() and (outside / "deep" / "keep").read_text() == "not ours\n"
