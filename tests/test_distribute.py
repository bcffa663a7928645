"""push / pull through a folder-backed stand-in for the hub API; offline fails fast.

Only our client's view of the hub is faked (FakeHub replaces HfApi); the validator, the staging
folder and the atomic publish are the real ones.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline import hubnet
from pipeline.cli import main
from pipeline.cli.reports import PullReport, PushReport
from pipeline.distribute import hub
from pipeline.distribute.publish import BUSY, HELD_BACK, HELD_BACK_FAILED
from pipeline.distribute.push import HELD_BACK as push_held_back
from pipeline.format.bundle_folder import CACHE_FILE
from pipeline.runtime import mount

from conftest import build_bundle, document, write_definition

REPO = "acme/prefix-bundles"


class FakeHub:
    """HfApi's methods we call, over a folder: one subfolder per commit, branches in `refs`."""

    endpoint = "https://hub.example"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.refs: dict[str, str] = {"main": "c0"}
        self.commits: list[SimpleNamespace] = []
        (root / "c0").mkdir(parents=True)
        (root / "c0" / "README.md").write_text("fleet bundles\n")

    def tree(self, revision: str | None = None) -> Path:
        return self.root / self.refs.get(revision or "main", revision or "main")

    def repo_info(self, repo_id, *, revision=None, repo_type=None):
        assert repo_id == REPO and repo_type == "model"
        return SimpleNamespace(sha=self.tree(revision).name)

    def list_repo_files(self, repo_id, *, revision=None, repo_type=None):
        tree = self.tree(revision)
        return sorted(str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file())

    def create_branch(self, repo_id, *, branch, repo_type=None, exist_ok=False):
        self.refs.setdefault(branch, self.refs["main"])

    def create_commit(self, repo_id, *, operations, commit_message, commit_description=None,
                      revision=None, repo_type=None):  # fmt: skip
        oid = f"c{len(self.commits) + 1}"
        shutil.copytree(self.tree(revision), self.root / oid)
        for op in operations:
            target = self.root / oid / op.path_in_repo
            if hasattr(op, "path_or_fileobj"):
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(op.path_or_fileobj, target)
            else:
                target.unlink()
        self.refs[revision or "main"] = oid
        self.commits.append(SimpleNamespace(message=commit_message, description=commit_description))
        return SimpleNamespace(oid=oid, commit_url=f"https://hub.example/{repo_id}/commit/{oid}")

    def snapshot_download(self, repo_id, *, repo_type=None, revision=None, allow_patterns=None,
                          local_dir=None):  # fmt: skip
        from huggingface_hub.utils import filter_repo_objects

        files = self.list_repo_files(repo_id, revision=revision)
        for name in filter_repo_objects(files, allow_patterns=allow_patterns):
            (Path(local_dir) / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.tree(revision) / name, Path(local_dir) / name)
        (Path(local_dir) / ".cache" / "huggingface").mkdir(parents=True, exist_ok=True)
        return local_dir


@pytest.fixture
def fake_hub(tmp_path: Path, monkeypatch) -> FakeHub:
    fake = FakeHub(tmp_path / "hub")
    monkeypatch.setattr(hub, "make_api", lambda: fake)
    monkeypatch.setattr(hubnet, "hub_offline", lambda: False)
    monkeypatch.setattr(hubnet, "probe", lambda endpoint, timeout: None)
    return fake


@pytest.fixture
def model(tmp_path: Path, tiny_model: Path) -> Path:
    """A deployable copy of the tiny model (pull writes into <model>/prefix-bundles)."""
    return Path(shutil.copytree(tiny_model, tmp_path / "deploy" / "tiny"))


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_push_then_pull_round_trip_is_byte_identical_and_mounts(
    fake_hub: FakeHub, shop_bundle: Path, model: Path, capsys
):
    assert main(["push", str(shop_bundle), "--repo", REPO, "--json"]) == 0
    pushed = document(PushReport, capsys.readouterr().out)
    repo_path = f"shop/1/{shop_bundle.name}"
    assert (pushed.repo, pushed.revision, pushed.commit) == (REPO, "main", "c1")
    assert pushed.url == f"https://hub.example/{REPO}/commit/c1" and pushed.deleted == []
    (b,) = pushed.bundles
    assert (b.status, b.path, b.repo_path) == ("pushed", str(shop_bundle), repo_path)
    assert (b.prefix, b.version, b.refusal, b.reason) == ("shop", 1, None, None)
    assert b.tokens > 50 and CACHE_FILE in b.files
    assert (pushed.totals.pushed, pushed.totals.skipped, pushed.totals.refused) == (1, 0, 0)
    assert fake_hub.commits[0].message == f"Push prefix bundles: shop@1 ({shop_bundle.name})"

    assert main(["pull", "--repo", REPO, "--model", str(model)]) == 0
    out = capsys.readouterr()
    local = model / "prefix-bundles" / repo_path
    assert "pulled shop@1 " in out.out and str(local) in out.out and out.err == ""
    assert files_of(local) == files_of(shop_bundle)
    assert sorted(p.name for p in (model / "prefix-bundles" / ".staging").iterdir()) == ["locks"]
    mounted = mount(model)  # default folder: <model>/prefix-bundles
    assert [b.name for b in mounted.bundles] == ["shop@1"] and not mounted.refused

    # pulling again replaces the bundle atomically with the same bytes
    assert main(["pull", "--repo", REPO, "--model", str(model), "--json"]) == 0
    again = document(PullReport, capsys.readouterr().out)
    assert (again.repo, again.revision, again.commit) == (REPO, "main", "c1")
    assert again.url == f"https://hub.example/{REPO}/tree/c1"
    assert (again.model, again.bundles_dir) == (str(model), str(model / "prefix-bundles"))
    (b,) = again.bundles
    assert (b.status, b.repo_path, b.path) == ("pulled", repo_path, str(local))
    assert (b.prefix, b.version, b.refusal, b.reason) == ("shop", 1, None, None)
    assert b.tokens == pushed.bundles[0].tokens
    assert (again.totals.pulled, again.totals.skipped, again.totals.refused) == (1, 0, 0)
    assert files_of(local) == files_of(shop_bundle)


def test_pull_takes_only_this_models_newest_bundles(
    fake_hub: FakeHub, tmp_path: Path, tiny_model: Path, tiny_model_other_weights: Path, capsys
):
    mine = tmp_path / "mine"
    write_definition(mine, tiny_model)
    v1 = build_bundle(mine, check=False)
    toml = mine / "prefixes" / "shop.toml"
    toml.write_text(toml.read_text().replace("version = 1", "version = 2"))
    v2 = build_bundle(mine, check=False)
    other = tmp_path / "other"
    write_definition(other, tiny_model_other_weights)
    theirs = build_bundle(other, check=False)
    assert main(["push", str(v1), str(v2), str(theirs), "--repo", REPO]) == 0
    assert len(fake_hub.commits) == 1  # one commit per push
    capsys.readouterr()

    dest = tmp_path / "served"
    assert main(["--bundles", str(dest), "pull", "--repo", REPO, "--model", str(tiny_model)]) == 0
    out = capsys.readouterr().out
    assert sorted(str(p.relative_to(dest)) for p in dest.glob("[!.]*/*/*")) == [f"shop/2/{v2.name}"]
    assert f"skipped shop/1/{v1.name}: older version" in out
    assert f"skipped shop/1/{theirs.name}: for another model ({theirs.name[-12:]})" in out

    # --prefix NAME@VERSION picks an older one; --bundles after the command works too
    assert main(["pull", "--repo", REPO, "--model", str(tiny_model), "--prefix", "shop@1",
                 "--bundles", str(dest), "--json"]) == 0  # fmt: skip
    assert (dest / "shop/1" / v1.name).is_dir() and not (dest / "shop/1" / theirs.name).exists()
    doc = document(PullReport, capsys.readouterr().out)
    assert [(b.repo_path, b.status, b.reason) for b in doc.bundles] == sorted(
        [
            (f"shop/1/{theirs.name}", "skipped", f"for another model ({theirs.name[-12:]})"),
            (f"shop/1/{v1.name}", "pulled", None),
            (f"shop/2/{v2.name}", "skipped", "not asked for"),
        ]
    )  # in repo_path order
    paths = {b.repo_path: b.path for b in doc.bundles}
    assert paths[f"shop/1/{v1.name}"] == str(dest / "shop/1" / v1.name)
    assert paths[f"shop/1/{theirs.name}"] is None and paths[f"shop/2/{v2.name}"] is None
    assert (doc.bundles_dir, doc.totals.pulled, doc.totals.skipped) == (str(dest), 1, 2)

    assert main(["pull", "--repo", REPO, "--model", str(tiny_model), "--prefix", "docs",
                 "--bundles", str(dest)]) == 1  # fmt: skip
    err = capsys.readouterr().err
    assert err.startswith(f"error: hub repo {REPO}@main: no bundle of docs for this model")
    assert err.count("\n") == 1


def test_pull_refuses_a_bundle_altered_on_the_hub_and_publishes_nothing(
    fake_hub: FakeHub, shop_bundle: Path, model: Path, capsys
):
    assert main(["push", str(shop_bundle), "--repo", REPO]) == 0
    hub_copy = fake_hub.tree() / "shop" / "1" / shop_bundle.name / CACHE_FILE
    data = bytearray(hub_copy.read_bytes())
    data[-1] ^= 0x01
    hub_copy.write_bytes(bytes(data))
    capsys.readouterr()

    assert main(["pull", "--repo", REPO, "--model", str(model)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: bundle shop/1/{shop_bundle.name} from hub repo {REPO}@c1")
    assert "blake3 mismatch" in err and err.rstrip().endswith("(nothing was published)")
    assert err.count("\n") == 1
    bundles = model / "prefix-bundles"
    assert [p.name for p in bundles.iterdir()] == [".staging"]
    assert [p.name for p in (bundles / ".staging").iterdir()] == ["locks"]  # download removed


def test_a_stray_file_in_a_hub_bundle_is_refused_before_any_download(
    fake_hub: FakeHub, shop_bundle: Path, model: Path, capsys, monkeypatch
):
    """Every file under the bundle's folder was downloaded (any size) before the validator
    refused the stray one; now the listing is read first and nothing is fetched."""
    assert main(["push", str(shop_bundle), "--repo", REPO]) == 0
    (fake_hub.tree() / "shop" / "1" / shop_bundle.name / "big.bin").write_bytes(b"x" * 4096)
    capsys.readouterr()
    monkeypatch.setattr(fake_hub, "snapshot_download", lambda *a, **k: pytest.fail("downloaded"))
    assert main(["pull", "--repo", REPO, "--model", str(model)]) == 1
    assert capsys.readouterr().err == (
        f"error: hub repo {REPO}: shop/1/{shop_bundle.name} holds 'big.bin', not a bundle file (a "
        "bundle holds SHA256SUMS, build-report.json, cache.safetensors, manifest.json, "
        "manifest.json.minisig); remove it from the repo or push the bundle again: nothing was "
        "published\n"
    )


def test_a_full_disk_during_a_hub_pull_names_the_folder_not_the_network(
    fake_hub: FakeHub, shop_bundle: Path, model: Path, capsys, monkeypatch
):
    import errno

    assert main(["push", str(shop_bundle), "--repo", REPO]) == 0
    capsys.readouterr()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fake_hub, "snapshot_download", full)
    assert main(["pull", "--repo", REPO, "--model", str(model)]) == 1
    assert capsys.readouterr().err == (
        f"error: cannot write under {model / 'prefix-bundles'} (No space left on device): free "
        "space there (or make it writable) and pull again; nothing was published\n"
    )


def test_pull_json_lists_the_refusal_and_the_valid_bundle_it_held_back(
    fake_hub: FakeHub, shop_bundle: Path, model: Path, tmp_path: Path, capsys
):
    write_definition(tmp_path / "faq", model, name="faq")
    faq = build_bundle(tmp_path / "faq", "faq", check=False)
    assert main(["push", str(shop_bundle), str(faq), "--repo", REPO]) == 0
    hub_copy = fake_hub.tree() / "shop" / "1" / shop_bundle.name / CACHE_FILE
    data = bytearray(hub_copy.read_bytes())
    data[-1] ^= 0x01
    hub_copy.write_bytes(bytes(data))
    capsys.readouterr()

    assert main(["pull", "--repo", REPO, "--model", str(model), "--json"]) == 1
    out = capsys.readouterr()
    doc = document(PullReport, out.out)
    bundles = model / "prefix-bundles"
    held, refused = doc.bundles
    assert (held.repo_path, held.status, held.reason) == (f"faq/1/{faq.name}", "skipped", HELD_BACK)
    assert held.path == str(bundles / "faq/1" / faq.name) and held.tokens > 50
    assert (refused.repo_path, refused.status) == (f"shop/1/{shop_bundle.name}", "refused")
    assert refused.path == str(bundles / "shop/1" / shop_bundle.name)
    assert refused.tokens is None and refused.reason is None
    assert (refused.refusal.check, refused.refusal.field) == ("data", CACHE_FILE)
    assert "blake3 mismatch" in refused.refusal.reason
    assert (doc.totals.pulled, doc.totals.skipped, doc.totals.refused) == (0, 1, 1)
    assert out.err == (
        f"error: bundle shop/1/{shop_bundle.name} from hub repo {REPO}@c1: "
        f"{refused.refusal.reason} (nothing was published)\n"
    )
    assert [p.name for p in bundles.iterdir()] == [".staging"]


def test_push_refuses_an_invalid_bundle_and_pushes_nothing(
    fake_hub: FakeHub, shop_bundle: Path, tmp_path: Path, capsys
):
    copy = Path(shutil.copytree(shop_bundle, tmp_path / "b" / "shop" / "1" / shop_bundle.name))
    (copy / "notes.txt").write_text("x")
    assert main(["push", str(shop_bundle), str(copy), "--repo", REPO]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: bundle {copy}: unexpected 'notes.txt'") and err.count("\n") == 1
    assert err.rstrip().endswith(f"(nothing was pushed to {REPO})")
    assert fake_hub.commits == []

    assert main(["push", str(shop_bundle), str(copy), "--repo", REPO, "--json"]) == 1
    out = capsys.readouterr()
    doc = document(PushReport, out.out)
    assert (doc.commit, doc.url, doc.revision, doc.deleted) == (None, None, "main", [])
    held, refused = doc.bundles
    assert (held.status, held.path, held.prefix) == ("skipped", str(shop_bundle), "shop")
    assert held.repo_path == f"shop/1/{shop_bundle.name}" and held.tokens > 50
    assert held.reason == push_held_back
    assert (refused.status, refused.path) == ("refused", str(copy))
    assert (refused.prefix, refused.repo_path, refused.tokens, refused.files) == (
        None,
        None,
        None,
        [],
    )
    assert (refused.refusal.check, refused.refusal.field) == ("files", "notes.txt")
    line = f"error: bundle {copy}: {refused.refusal.reason} (nothing was pushed to {REPO})"
    assert out.err == line + "\n"
    assert (doc.totals.pushed, doc.totals.skipped, doc.totals.refused) == (0, 1, 1)
    assert fake_hub.commits == []


def one_line_fast(argv: list[str], capsys) -> str:
    start = time.perf_counter()
    assert main(argv) == 1
    seconds = time.perf_counter() - start
    err = "".join(line for line in capsys.readouterr().err.splitlines(True) if line[:5] != "BLAS:")
    assert seconds < 1.0, f"{argv[0]} took {seconds:.2f} s"
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_push_and_pull_fail_fast_offline(
    monkeypatch, shop_bundle: Path, tiny_model: Path, tmp_path: Path, capsys
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pull = ["pull", "--repo", REPO, "--model", str(tiny_model), "--bundles", str(tmp_path / "b")]
    for argv in (["push", str(shop_bundle), "--repo", REPO], pull):
        err = one_line_fast(argv, capsys)
        assert f"hub repo {REPO}: HF_HUB_OFFLINE is set;" in err
    assert "copy the bundles into" in err and not (tmp_path / "b").exists()


def test_push_and_pull_fail_fast_when_the_hub_is_unreachable(
    monkeypatch, shop_bundle: Path, tiny_model: Path, tmp_path: Path, capsys
):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    pull = ["pull", "--repo", REPO, "--model", str(tiny_model), "--bundles", str(tmp_path / "b")]
    for argv in (["push", str(shop_bundle), "--repo", REPO], pull):
        err = one_line_fast(argv, capsys)
        assert f"hub repo {REPO}: cannot reach http://127.0.0.1:9 (ConnectError" in err


def test_a_hub_model_in_a_definition_fails_fast_offline(
    monkeypatch, tmp_path: Path, tiny_model: Path, capsys
):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))  # nothing cached
    toml = write_definition(tmp_path, tiny_model)
    revision = "c1899de289a04d12100db370d81485cdf75e47ca"
    toml.write_text(
        toml.read_text().replace(
            f'path = "{tiny_model}"', f'repo = "Qwen/Qwen3-0.6B"\nrevision = "{revision}"'
        )
    )
    argv = ["--prefixes", str(tmp_path / "prefixes"), "--bundles", str(tmp_path / "b"), "build"]
    err = one_line_fast(argv, capsys)
    assert err.startswith(
        f"error: model Qwen/Qwen3-0.6B@{revision}: not in the local hub cache: "
        "HF_HUB_OFFLINE is set; "
    )
    assert err.rstrip().endswith("or pre-download it and use models.path")


def test_a_bad_repo_id_is_a_usage_error(fake_hub: FakeHub, shop_bundle: Path, capsys):
    assert main(["push", str(shop_bundle), "--repo", "no-slash"]) == 1
    assert capsys.readouterr().err == (
        "error: --repo 'no-slash' is not a hub repo id; pass it as ORG/NAME\n"
    )


@pytest.mark.parametrize(
    ("error", "status", "says"),
    [
        ("RepositoryNotFoundError", 404, "repo not found or no access; check the name, create it"),
        ("RevisionNotFoundError", 404, "revision dev not found; pass an existing branch, tag"),
        ("HfHubHTTPError", 403, "not authorized (HTTP 403); set HF_TOKEN to a token with write"),
        ("HfHubHTTPError", 500, "HTTP 500 (boom); retry later"),
    ],
)
def test_hub_errors_are_one_line_naming_the_repo(error: str, status: int, says: str):
    from huggingface_hub import errors

    from pipeline.format.errors import PipelineError

    response = SimpleNamespace(status_code=status, headers={}, request=None)
    with pytest.raises(PipelineError) as info, hub.hub_errors(REPO, "dev", "push to"):
        raise getattr(errors, error)("boom\ndetails", response=response)
    assert str(info.value).startswith(f"push to hub repo {REPO}: {says}")
    assert "\n" not in str(info.value)


# --- all or nothing (issue 16, finding 6) ---------------------------------------------------------


def hold_build_lock(bundles: Path, dest: Path):
    """A concurrent process (as a build would) holding dest's build lock until it is killed."""
    import subprocess
    import sys

    code = (
        "import sys, time\nfrom pathlib import Path\n"
        "from pipeline.builder.writer import target_lock\n"
        f"with target_lock(Path({str(bundles)!r}), Path({str(dest)!r})):\n"
        "    print('held', flush=True)\n    time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def push_two(fake_hub: FakeHub, shop_bundle: Path, model: Path, tmp_path: Path, capsys) -> Path:
    write_definition(tmp_path / "faq", model, name="faq")
    faq = build_bundle(tmp_path / "faq", "faq", check=False)
    assert main(["push", str(shop_bundle), str(faq), "--repo", REPO]) == 0
    capsys.readouterr()
    return faq


def test_pull_publishes_nothing_when_one_target_is_locked_and_json_says_so(
    fake_hub: FakeHub, shop_bundle: Path, model: Path, tmp_path: Path, capsys
):
    """Two valid bundles, the second's build lock held by a concurrent build: neither lands, and
    --json lists both (the first held back, the second failed)."""
    faq = push_two(fake_hub, shop_bundle, model, tmp_path, capsys)
    bundles = model / "prefix-bundles"
    shop_dest = bundles / "shop/1" / shop_bundle.name
    holder = hold_build_lock(bundles, shop_dest)
    try:
        assert main(["pull", "--repo", REPO, "--model", str(model), "--json"]) == 1
    finally:
        holder.kill()
        holder.wait()
    out = capsys.readouterr()
    doc = document(PullReport, out.out)
    held, failed = doc.bundles
    assert (held.repo_path, held.status, held.path) == (
        f"faq/1/{faq.name}",
        "skipped",
        str(bundles / "faq/1" / faq.name),
    )
    assert held.reason == HELD_BACK_FAILED and held.tokens > 50
    busy = BUSY.format(shop_dest)
    assert (failed.repo_path, failed.status, failed.reason) == (
        f"shop/1/{shop_bundle.name}",
        "failed",
        busy,
    )
    assert failed.path == str(shop_dest) and failed.tokens > 50 and failed.refusal is None
    totals = doc.totals
    assert (totals.pulled, totals.skipped, totals.refused, totals.failed) == (0, 1, 0, 1)
    assert out.err == f"error: bundle shop/1/{shop_bundle.name}: {busy} (nothing was published)\n"
    assert out.err.count("nothing was published") == 1  # said once, not twice
    assert sorted(p.name for p in bundles.iterdir()) == [".staging"]
    assert sorted(p.name for p in (bundles / ".staging").iterdir()) == ["locks"]
    # once the other build is done, the same pull publishes both
    assert main(["pull", "--repo", REPO, "--model", str(model)]) == 0
    assert (bundles / "faq/1" / faq.name).is_dir() and shop_dest.is_dir()


def test_pull_undoes_what_it_placed_when_a_later_move_fails(
    fake_hub: FakeHub, shop_bundle: Path, model: Path, tmp_path: Path, capsys
):
    """faq is moved into place, then shop's prefix folder turns out to be a link: faq's move is
    undone (its older copy back in place), the link and its target are left alone."""
    faq = push_two(fake_hub, shop_bundle, model, tmp_path, capsys)
    bundles = model / "prefix-bundles"
    old_faq = bundles / "faq/1" / faq.name
    old_faq.mkdir(parents=True)
    (old_faq / "marker").write_text("the bundle that was there before\n")
    outside = tmp_path / "outside"
    (outside / "1" / shop_bundle.name).mkdir(parents=True)
    (outside / "1" / shop_bundle.name / "keep").write_text("not ours\n")
    (bundles / "shop").symlink_to(outside, target_is_directory=True)

    assert main(["pull", "--repo", REPO, "--model", str(model), "--json"]) == 1
    out = capsys.readouterr()
    doc = document(PullReport, out.out)
    held, failed = doc.bundles
    assert (held.status, held.reason) == ("skipped", HELD_BACK_FAILED)
    assert failed.status == "failed" and failed.reason.startswith(
        f"cannot publish it ({bundles / 'shop'} is a symlink ({outside}); nothing under the "
        f"bundles folder {bundles} is created, renamed or deleted through a link"
    )
    assert os.listdir(old_faq) == ["marker"]  # the older faq is back, untouched
    assert os.listdir(outside / "1" / shop_bundle.name) == ["keep"]
    assert sorted(p.name for p in (bundles / ".staging").iterdir()) == ["locks"]


def test_pull_refuses_a_linked_staging_folder_and_leaves_its_target(
    fake_hub: FakeHub, shop_bundle: Path, model: Path, tmp_path: Path, capsys
):
    """A dead pull's leftovers are cleaned from .staging; a .staging that links out of the tree
    is refused before anything is downloaded, and the link's target keeps what it holds."""
    import subprocess
    import sys

    assert main(["push", str(shop_bundle), "--repo", REPO]) == 0
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    outside = tmp_path / "elsewhere"
    (outside / f"{dead}-precious").mkdir(parents=True)
    bundles = model / "prefix-bundles"
    bundles.mkdir()
    (bundles / ".staging").symlink_to(outside, target_is_directory=True)
    capsys.readouterr()
    assert main(["pull", "--repo", REPO, "--model", str(model)]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"error: {bundles / '.staging'} is a symlink ({outside}); nothing under the bundles folder "
        f"{bundles} is created, renamed or deleted through a link: replace it with a real folder\n"
    )
    assert os.listdir(outside) == [f"{dead}-precious"]
    assert sorted(p.name for p in bundles.iterdir()) == [".staging"]
