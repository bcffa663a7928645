"""Every manifest kind reaches every command as one refusal or one use (issue 48, finding 6): a
valid manifest of kind `snapshot` where a prefix bundle is expected (a registry artifact, a
folder in the bundles layout) is one line, never an AttributeError."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from registry_env import registry
from test_cli_read_side import as_snapshot, edit
from test_distribute import fake_hub  # noqa: F401 - the fixture, used below
from test_oci import no_docker_config  # noqa: F401 - autouse: no credentials of this machine

from pipeline.cli import main
from pipeline.distribute.oci_push import push_oci
from pipeline.distribute.pinned import file_ids
from pipeline.distribute.push import CheckedBundle
from pipeline.format.bundle_folder import read_manifest

KIND = "its manifest is of kind snapshot, not prefix"


def snapshot_in_layout(shop_bundle: Path, root: Path) -> Path:
    """A copy of the shop bundle at <root>/shop/1/<folder> whose manifest.json is a valid
    manifest of kind snapshot (SHA256SUMS recomputed: anyone can)."""
    bundle = root / "shop" / "1" / shop_bundle.name
    shutil.copytree(shop_bundle, bundle)
    edit(bundle, as_snapshot)
    return bundle


def forged(bundle: Path) -> CheckedBundle:
    """What push_oci would take for a bundle the validator passed: here one it refuses, as any
    client able to push to the repository can publish it."""
    m = read_manifest(bundle, None, kind=None)
    ids = file_ids(bundle)
    return CheckedBundle(
        local=bundle, name="shop", version=1, repo_path=f"shop/1/{bundle.name}",
        files=tuple(n for n, _ in ids), cache_sha256=m.cache.file_sha256,
        tokens=m.tokens.count, ids=ids,
    )  # fmt: skip


def test_a_snapshot_artifact_under_a_bundle_tag_is_one_line_on_pull(
    tmp_path: Path, shop_bundle: Path, tiny_model: Path, capsys
):
    bundle = snapshot_in_layout(shop_bundle, tmp_path / "forged")
    model = Path(shutil.copytree(tiny_model, tmp_path / "deploy" / "tiny"))
    with registry(tmp_path / "registry") as reg:
        push_oci([forged(bundle)], reg.repo())
        code = main(["pull", "--repo", reg.repo(), "--model", str(model)])
        tag = f"shop.V1.{bundle.name}"
        assert (code, capsys.readouterr().err) == (
            1,
            f"error: bundle shop/1/{bundle.name} from registry repo {reg.repo()} (tag {tag}): "
            f"{KIND}: not a prefix bundle; push the bundle again; nothing was published\n",
        )
    assert not (model / "prefix-bundles" / "shop").exists()


MESSAGES = '[{"role":"user","content":"hi"}]'
COMMANDS = {  # the command line for (bundles root, snapshot folder, model, secret key)
    "verify": lambda r, b, m, k: ["--bundles", str(r), "verify", str(b), "--model", str(m)],
    "verify-folder": lambda r, b, m, k: ["--bundles", str(r), "verify", "--model", str(m)],
    "inspect": lambda r, b, m, k: ["inspect", str(b), "--model", str(m)],
    "sign": lambda r, b, m, k: ["sign", str(b), "--key", str(k)],
    "push-hub": lambda r, b, m, k: ["push", str(b), "--repo", "acme/prefix-bundles"],
    "list": lambda r, b, m, k: ["--bundles", str(r), "list"],
    "prune": lambda r, b, m, k: ["--bundles", str(r), "prune"],
    "match": lambda r, b, m, k: [
        "--bundles",
        str(r),
        "match",
        "--model",
        str(m),
        "--messages",
        MESSAGES,
    ],  # fmt: skip
}


@pytest.mark.usefixtures("fake_hub")
@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_command_meets_a_snapshot_kind_folder_with_one_line_or_one_use(
    command: str, project: Path, shop_bundle: Path, tiny_model: Path, capsys, monkeypatch
):
    root = project / "bundles"
    bundle = snapshot_in_layout(shop_bundle, root)
    key = project / "minisign.key"
    assert main(["keygen", "--secret-key", str(key), "--unencrypted"]) == 0
    monkeypatch.chdir(project)  # prefixes/ of the project: list and prune read the definitions
    capsys.readouterr()
    code = main(COMMANDS[command](root, bundle, tiny_model, key))
    out = capsys.readouterr()
    assert code in (0, 1), out.err
    assert "Traceback" not in out.err and "Error:" not in out.out + out.err, out.err
    errors = [line for line in out.err.splitlines() if line.startswith("error: ")]
    assert all(KIND in line for line in errors), errors
    if command in ("verify", "verify-folder", "push-hub", "sign"):
        assert code == 1 and len(errors) == 1, out.err
