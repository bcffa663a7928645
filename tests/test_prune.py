"""`prune`: a dry run by default; --apply deletes old versions, orphans and dead staging folders only.

Real bundles: shop@1 and shop@2 built for the tiny model, and an orphan (its definition removed).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.builder.writer import staging_root, target_lock
from pipeline.cli import main
from pipeline.cli.reports import PruneReport
from pipeline.format.lockfile import LockedPrefix, Lockfile, write_lock
from pipeline.format.safe_tree import remove_at
from pipeline.runtime import find_bundles, mount

from conftest import build_bundle, write_definition

HEX = "0" * 64


def cli(project: Path, *argv: str) -> int:
    return main(
        ["--prefixes", str(project / "prefixes"), "--bundles", str(project / "bundles"), *argv]
    )


def bump(project: Path, name: str = "shop") -> None:
    path = project / "prefixes" / f"{name}.toml"
    text = path.read_text()
    version = int(text.split("version = ", 1)[1].split("\n", 1)[0])
    text = text.replace(f"version = {version}\n", f"version = {version + 1}\n")
    path.write_text(text.replace("bookshop", f"bookshop {version + 1}"))


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          check=True, capture_output=True, text=True)  # fmt: skip
    return int(done.stdout)


def snapshot(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def shop(project: Path, tiny_model: Path) -> dict[str, Path]:
    """shop@1, shop@2, gone@1 (definition deleted) and a dead build's staging folder."""
    old = build_bundle(project)
    bump(project)
    new = build_bundle(project)
    write_definition(project, tiny_model, name="gone")
    orphan = build_bundle(project, "gone")
    (project / "prefixes" / "gone.toml").unlink()
    staging = staging_root(project / "bundles") / f"{dead_pid()}-abcd1234"
    staging.mkdir()
    (staging / "cache.safetensors").write_bytes(b"x" * 1000)
    return {"old": old, "new": new, "orphan": orphan, "staging": staging}


def prune_json(project: Path, capsys, *argv: str) -> tuple[int, PruneReport]:
    code = cli(project, "prune", "--json", *argv)
    return code, PruneReport.model_validate_json(capsys.readouterr().out, strict=True)


def test_dry_run_lists_with_sizes_and_deletes_nothing(project: Path, shop, capsys):
    before = snapshot(project / "bundles")
    code, doc = prune_json(project, capsys)
    assert code == 0 and not doc.applied and doc.keep == 1
    listed = {f.path: f for f in doc.delete}
    assert sorted(listed) == sorted(str(shop[k]) for k in ("old", "orphan", "staging"))
    assert (
        listed[str(shop["old"])].kind == "older-version" and listed[str(shop["old"])].version == 1
    )
    assert listed[str(shop["orphan"])].kind == "no-definition"
    assert (
        listed[str(shop["staging"])].kind == "staging"
        and listed[str(shop["staging"])].bytes == 1000
    )
    size = sum(p.stat().st_size for p in shop["old"].iterdir())
    assert listed[str(shop["old"])].bytes == size
    assert {f.status for f in doc.delete} == {"would-delete"}
    assert doc.totals.bytes == sum(f.bytes for f in doc.delete) and doc.totals.deleted == 0
    assert snapshot(project / "bundles") == before
    assert cli(project, "prune") == 0
    out = capsys.readouterr().out
    assert (
        "would delete " in out
        and f"{shop['old']}  (older than the newest 1 version(s) of shop for " in out
    )
    assert "run with --apply to delete them" in out


def test_apply_deletes_them_and_the_newest_still_mounts(
    project: Path, shop, tiny_model: Path, capsys
):
    code, doc = prune_json(project, capsys, "--apply")
    assert code == 0 and doc.applied and doc.totals.deleted == 3 and doc.totals.failed == 0
    assert doc.totals.deleted_bytes == doc.totals.bytes
    for key in ("old", "orphan", "staging"):
        assert not shop[key].exists()
    assert not (project / "bundles" / "gone").exists()  # emptied prefix folders go too
    assert not (project / "bundles" / "shop" / "1").exists()
    assert [p.name for p in staging_root(project / "bundles").iterdir()] == ["locks"]
    mounted = mount(tiny_model, project / "bundles", skip_refused=True)
    assert [b.path for b in mounted.bundles] == [shop["new"]] and mounted.refused == []
    assert prune_json(project, capsys)[1].delete == []  # nothing left to prune


def test_a_version_named_in_the_lockfile_is_never_deleted(project: Path, shop, capsys):
    locked = LockedPrefix(version=1, content_sha256=HEX, template_sha256=HEX, models={})
    write_lock(
        project / "prefixes" / "prefixes.lock", Lockfile(prefixes={"shop": locked, "gone": locked})
    )
    code, doc = prune_json(project, capsys, "--apply")
    assert code == 0 and [f.path for f in doc.delete] == [str(shop["staging"])]
    assert sorted(k.path for k in doc.kept) == sorted([str(shop["old"]), str(shop["orphan"])])
    assert all("is named in" in k.reason and k.version == 1 for k in doc.kept)
    assert shop["old"].is_dir() and shop["orphan"].is_dir()


def test_a_lockfile_that_is_a_link_to_nothing_stops_prune_and_is_written_through(
    project: Path, shop, capsys, tmp_path: Path
):
    """prefixes.lock a link to the release repo's lockfile: moved away, it was read as empty and
    prune would delete the versions it pins; a build replaced the link by a file of its own."""
    release = tmp_path / "release"
    release.mkdir()
    locked = LockedPrefix(version=1, content_sha256=HEX, template_sha256=HEX, models={})
    write_lock(release / "prefixes.lock", Lockfile(prefixes={"shop": locked}))
    link = project / "prefixes" / "prefixes.lock"
    link.symlink_to(release / "prefixes.lock")
    write_lock(link, Lockfile(prefixes={"shop": locked, "gone": locked}))  # through the link
    assert link.is_symlink() and "gone" in (release / "prefixes.lock").read_text()
    release.rename(tmp_path / "moved")
    assert cli(project, "prune", "--apply") == 1
    assert capsys.readouterr().err == (
        f"error: {link}: is a link to {release / 'prefixes.lock'}, which does not exist; restore "
        "the lockfile it names, or remove the link\n"
    )
    assert shop["old"].is_dir() and shop["orphan"].is_dir()


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"lock_version": 1, "prefixes": {}, "prefixes": {}}', "has the key 'prefixes' twice in one object"),
        (None, "is a FIFO, not a regular file"),
    ],
    ids=["key-twice", "fifo"],
)  # fmt: skip
def test_a_lockfile_with_a_key_twice_or_not_a_file_is_one_line(
    text, why: str, project: Path, shop, capsys, tiny_model: Path
):
    """A key twice: the last one won (shop@7 over shop@1), though parsers disagree; a FIFO given
    to --lockfile was 'not found'."""
    path = project / "prefixes" / "prefixes.lock"
    if text is None:
        os.mkfifo(path)
    else:
        path.write_text(text)
    assert cli(project, "prune") == 1
    assert capsys.readouterr().err.startswith(f"error: {path}: {why}")
    messages = '[{"role": "user", "content": "hi"}]'
    argv = ["match", "--model", str(tiny_model), "--lockfile", str(path), "--messages", messages]
    assert main(argv) != 0
    assert capsys.readouterr().err.startswith(f"error: {path}: {why}")


def test_keep_two_keeps_both_versions(project: Path, shop, capsys):
    doc = prune_json(project, capsys, "--keep", "2")[1]
    assert {f.kind for f in doc.delete} == {"no-definition", "staging"}


def test_a_bundle_is_never_half_deleted_in_place(project: Path, shop, capsys, monkeypatch):
    import pipeline.format.safe_tree as bundles_tree

    def fail(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(bundles_tree, "remove_at", fail)
    code, doc = prune_json(project, capsys, "--apply", "--keep", "1")
    assert code == 1
    failed = {f.path: f for f in doc.delete if f.status == "failed"}
    assert str(shop["old"]) in failed and "Permission denied" in failed[str(shop["old"])].error
    assert not shop["old"].exists()  # renamed away before the removal started
    moved = [p for p in staging_root(project / "bundles").iterdir() if "-prune-" in p.name]
    assert moved and all(p.name.startswith(f"{os.getpid()}-prune-") for p in moved)
    assert shop["old"] not in find_bundles(project / "bundles")[0]


def test_a_bundle_a_build_is_writing_is_left_alone(project: Path, shop, capsys):
    with target_lock(project / "bundles", shop["old"]):
        code, doc = prune_json(project, capsys, "--apply")
    assert code == 1 and shop["old"].is_dir()
    (failed,) = [f for f in doc.delete if f.status == "failed"]
    assert failed.error.endswith("a build is writing it right now; run prune again when it is done")


def test_prune_refuses_without_definitions_and_bad_keep(project: Path, tmp_path: Path, capsys):
    (project / "bundles").mkdir()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["prune", "--prefixes", str(empty), "--bundles", str(project / "bundles")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: no prefix definitions (*.toml) in {empty}/; pass --prefixes")
    assert len(err.splitlines()) == 1
    with pytest.raises(SystemExit) as exit_:
        cli(project, "prune", "--keep", "0")
    assert exit_.value.code == 2


def test_prune_refuses_a_prefixes_folder_whose_toml_is_no_definition(
    project: Path, shop, tmp_path: Path, capsys
):
    """A wrong --prefixes (a project root whose only *.toml is pyproject.toml) would make every
    bundle one of a prefix without a definition: prune reads every definition first and refuses
    (before: it deleted shop's bundles and exited 0; outside review)."""
    wrong = tmp_path / "repo"
    wrong.mkdir()
    (wrong / "pyproject.toml").write_text('[project]\nname = "x"\n')
    before = snapshot(project / "bundles")
    args = ["--prefixes", str(wrong), "--bundles", str(project / "bundles"), "prune", "--apply"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {wrong / 'pyproject.toml'}: ") and len(err.splitlines()) == 1
    assert err.rstrip().endswith("fix that file or pass the right --prefixes")
    assert snapshot(project / "bundles") == before


def test_prune_never_touches_folders_outside_the_layout(project: Path, shop, capsys):
    """Only <prefix name>/<version>/<slug>-<fingerprint12> folders are bundles: a user's own
    folders in the tree stay (before: prune deleted them as older versions or orphans)."""
    theirs = [
        project / "bundles" / "Backups" / "1" / "x",  # not a prefix name
        project / "bundles" / "shop" / "1" / "my-notes",  # not a model folder
        project / "bundles" / "gone" / "notes.d",
    ]
    for folder in theirs:
        folder.mkdir(parents=True)
        (folder / "keep.txt").write_text("mine\n")
    assert cli(project, "prune", "--apply") == 0
    assert all((folder / "keep.txt").read_text() == "mine\n" for folder in theirs)
    assert not shop["old"].exists() and not shop["orphan"].exists()


def test_a_folder_of_the_layout_that_is_no_bundle_is_kept_with_its_reason(
    project: Path, shop, capsys
):
    """A prefix without a definition loses its bundles, not a user's folder spelled like one
    (before: `zz/1/<model folder>/thesis.txt` was deleted as a bundle of no definition)."""
    theirs = project / "bundles" / "zz" / "1" / shop["orphan"].name
    theirs.mkdir(parents=True)
    (theirs / "thesis.txt").write_text("precious\n")
    code, report = prune_json(project, capsys, "--apply")
    assert code == 0 and (theirs / "thesis.txt").read_text() == "precious\n"
    assert not shop["orphan"].exists()  # gone@1: a whole bundle of no definition
    kept = {Path(k.path): k.reason for k in report.kept}
    assert kept[theirs] == "no definition, and not a whole bundle of it: left for you to look at"


def test_a_staging_leftover_of_any_depth_is_sized_and_removed(project: Path, shop, capsys):
    """A dead build's staging folder nested past Python's recursion limit: prune's plan and its
    removal walk it without recursion (before: a RecursionError traceback in the dry run, and
    one in .staging stopped every build and prune; outside review)."""
    fd = os.open(shop["staging"], os.O_RDONLY)
    for _ in range(1200):  # longer than a path may be: made folder by folder
        os.mkdir("d", dir_fd=fd)
        fd, parent = os.open("d", os.O_RDONLY, dir_fd=fd), fd
        os.close(parent)
    with open(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd), "wb") as deepest:
        deepest.write(b"x" * 10)
    try:
        code, report = prune_json(project, capsys)
        staging = [f for f in report.delete if f.kind == "staging"]
        assert code == 0 and staging[0].bytes == 1010
        assert cli(project, "prune", "--apply") == 0
        assert not shop["staging"].exists()
    finally:  # pytest's own clean-up of old temporary folders recurses: never leave it there
        if shop["staging"].exists():
            parent = os.open(shop["staging"].parent, os.O_RDONLY)
            remove_at(parent, shop["staging"].name)
            os.close(parent)


def test_a_newer_version_that_is_not_whole_never_costs_the_one_before(project: Path, shop, capsys):
    """A copy of shop@2 cut short (its cache file truncated, or still arriving): prune keeps
    shop@1, the newest version that looks whole, and does not delete the broken one either
    (before: judged by version number only, shop@1 was deleted; outside review)."""
    cache = shop["new"] / "cache.safetensors"
    cache.write_bytes(cache.read_bytes()[:100])
    code, report = prune_json(project, capsys)
    doomed = {Path(f.path) for f in report.delete}
    assert code == 0 and shop["old"] not in doomed and shop["new"] not in doomed
    (shop["new"] / "manifest.json").unlink()  # files missing: the same
    code, report = prune_json(project, capsys)
    assert shop["old"] not in {Path(f.path) for f in report.delete}
