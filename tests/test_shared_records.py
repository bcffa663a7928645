"""Files several commands write at once keep every writer's entries (issue 36): prefixes.lock, the
build record and the sha256 memo, with the interleavings forced (a build's report callback runs
another build in the middle of it, a child process holds the lock)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.builder.batch import BuildPlan, build_all, select_definitions
from pipeline.format.errors import PipelineError
from pipeline.format.lockfile import LockError, lock_path, read_lock

from conftest import SYSTEM, write_definition


def plan(root: Path) -> BuildPlan:
    return BuildPlan(root / "prefixes", root / "bundles")


def run(root: Path, names: list[str], during=None) -> None:
    """build_all for `names`; `during(outcome)` runs after each target is built, before the
    lockfile entry of its definition is written (where another build may interleave)."""

    def report(outcome) -> None:
        if during is not None and outcome.error is None:
            during(outcome)

    definitions = select_definitions(root / "prefixes", names)
    build_all(definitions, plan(root), report, fail_fast=True, check=False)


def bump(root: Path, name: str, version: int, text: str) -> None:
    path = root / "prefixes" / f"{name}.toml"
    body = path.read_text().replace(json.dumps(SYSTEM), json.dumps(SYSTEM + text))
    path.write_text(body.replace("version = 1", f"version = {version}"))


def test_a_build_in_the_middle_of_another_keeps_its_lock_entry(tmp_path: Path, tiny_model: Path):
    """While `build a z` is between a and z, `build m` runs whole: m's entry survives z's update
    (the old code rewrote the whole file from the copy it read at the start)."""
    for name in ("a", "m", "z"):
        write_definition(tmp_path, tiny_model, name)
    done = []

    def interleave(outcome) -> None:
        if outcome.definition.name == "a" and not done:
            done.append(True)
            run(tmp_path, ["m"])

    run(tmp_path, ["a", "z"], during=interleave)
    assert done
    assert sorted(read_lock(lock_path(tmp_path / "prefixes")).prefixes) == ["a", "m", "z"]


def test_a_version_bump_by_another_build_is_never_reverted(tmp_path: Path, tiny_model: Path):
    """`build a m` read m@1; meanwhile m is bumped to 2 and built. The first build's m@1 entry is
    refused with one line (a silent win of either would be wrong), m@2 stays locked."""
    for name in ("a", "m"):
        write_definition(tmp_path, tiny_model, name)

    def interleave(outcome) -> None:
        if outcome.definition.name == "m" and outcome.definition.version == 1:
            bump(tmp_path, "m", 2, " Version two.")
            run(tmp_path, ["m"])

    with pytest.raises(LockError) as info:
        run(tmp_path, ["a", "m"], during=interleave)
    lock_file = lock_path(tmp_path / "prefixes")
    assert str(info.value) == (
        f"m@1: its bundles are built and published, but prefixes.lock does not record them: "
        f"{lock_file}: m@2 was locked by another build while this one built m@1; this build's "
        "entry is not recorded: build m again"
    )
    lock = read_lock(lock_file)
    assert lock.prefixes["m"].version == 2 and "a" in lock.prefixes


def test_the_same_version_with_other_content_is_one_refusal(tmp_path: Path, tiny_model: Path):
    from pipeline.format.lockfile import LockedPrefix, merge_entry

    h = "0" * 64
    a, b = "a-0123456789ab", "b-0123456789ab"  # model folders
    now = LockedPrefix(version=3, content_sha256="1" * 64, template_sha256=h, models={a: h})
    built = LockedPrefix(version=3, content_sha256="2" * 64, template_sha256=h, models={b: h})
    with pytest.raises(LockError, match=r"x@3 was locked by another build with other content"):
        merge_entry(tmp_path / "prefixes.lock", "x", now, built)
    same = built.model_copy(update={"content_sha256": "1" * 64})
    assert merge_entry(tmp_path, "x", now, same).models == {a: h, b: h}  # models merge


def test_the_lockfile_update_waits_for_a_lock_another_process_holds(tmp_path: Path):
    """A process holding the lockfile's lock (as a concurrent build does for its update) makes
    this update wait, then merge with what that process wrote."""
    from pipeline.format.lockfile import LockedPrefix, update_lock

    path = tmp_path / "prefixes.lock"
    h = "0" * 64
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "held"
    entry = LockedPrefix(version=1, content_sha256=h, template_sha256=h, models={})
    finished = threading.Event()
    worker = threading.Thread(target=lambda: (update_lock(path, "mine", entry), finished.set()))
    worker.start()
    assert not finished.wait(0.5)  # blocked on the other process's lock
    holder.wait(timeout=30)
    worker.join(timeout=30)
    assert finished.is_set()
    assert sorted(read_lock(path).prefixes) == ["mine", "theirs"]


_HOLDER = """
import sys, time
from pathlib import Path
from filelock import FileLock
from pipeline.format.lockfile import LockedPrefix, Lockfile, write_lock
path = Path(sys.argv[1])
with FileLock(str(path.with_name(f".{path.name}.lock"))):
    print("held", flush=True)
    time.sleep(1.5)
    h = "0" * 64
    entry = LockedPrefix(version=1, content_sha256=h, template_sha256=h, models={})
    write_lock(path, Lockfile(prefixes={"theirs": entry}))
"""


def test_a_read_only_prefixes_folder_is_one_error_line(tmp_path: Path, tiny_model: Path):
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder")
    write_definition(tmp_path, tiny_model, "a")
    (tmp_path / "prefixes").chmod(0o555)
    try:
        with pytest.raises(PipelineError, match=r"cannot lock .*prefixes.lock for update"):
            run(tmp_path, ["a"])
    finally:
        (tmp_path / "prefixes").chmod(0o755)


def test_the_build_record_keeps_entries_written_beside_it(tmp_path: Path, monkeypatch):
    """Two processes recording builds at once lose neither entry (read-modify-write under the
    record's file lock)."""
    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "memo"))
    script = (
        "import sys\n"
        "from pipeline.format.memo import update_table\n"
        "from pipeline.builder.build_record import record_path\n"
        "tag = sys.argv[1]\n"
        "for i in range(40):\n"
        "    update_table(record_path(), lambda t, i=i: {**t, f'{tag}{i:063x}'[:64]: '0' * 64})\n"
    )
    env = {**os.environ, "PREFIX_BUNDLES_CACHE_DIR": str(tmp_path / "memo")}
    procs = [
        subprocess.Popen([sys.executable, "-c", script, tag], env=env) for tag in ("a", "b", "c")
    ]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    from pipeline.builder.build_record import record_path
    from pipeline.format.memo import load_table

    assert len(load_table(record_path())) == 120


def test_a_full_build_record_forgets_its_oldest_entries_not_its_newest(tmp_path: Path, monkeypatch):
    """At MAX_ENTRIES the record drops the entries recorded longest ago: a bundle just built stays
    a proven parent whatever its manifest digest (a record kept in digest order dropped the
    smallest digest, so a fresh bundle could be forgotten by the very next build)."""
    from pipeline.builder.build_record import MAX_ENTRIES, built_here, record_built, record_path
    from pipeline.format.memo import update_table

    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "memo"))
    update_table(record_path(), lambda t: {f"f{i:063x}": "0" * 64 for i in range(MAX_ENTRIES)})
    built = lambda sha: SimpleNamespace(cache=SimpleNamespace(file_sha256=sha))  # noqa: E731
    record_built("0" * 64, built("1" * 64))  # the smallest digest there is, recorded last
    record_built("e" * 64, built("2" * 64))  # the next build
    assert built_here("0" * 64, built("1" * 64)) and built_here("e" * 64, built("2" * 64))
    assert not built_here(f"f{0:063x}", built("0" * 64))  # the oldest two went
    assert not built_here(f"f{1:063x}", built("0" * 64))
    assert built_here(f"f{2:063x}", built("0" * 64))


def test_sign_waits_for_no_build_it_refuses_while_one_writes_the_bundle(
    tmp_path: Path, shop_bundle: Path
):
    """`sign` takes the bundle's build lock: a build swapping the folder between the validation
    and the signature would leave a signature over the old manifest in the new bundle."""
    import shutil

    from pipeline.builder.signing import sign_bundle
    from pipeline.builder.writer import target_lock
    from pipeline.format.secret_key import generate

    bundles = tmp_path / "bundles"
    bundle = bundles / "shop" / "1" / shop_bundle.name
    shutil.copytree(shop_bundle, bundle)
    key = generate()
    with target_lock(bundles, bundle):
        with pytest.raises(PipelineError, match="a build is writing this bundle right now"):
            sign_bundle(bundle, key)
    assert not (bundle / "manifest.json.minisig").exists()
    assert sign_bundle(bundle, key).signature is not None
