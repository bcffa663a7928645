"""A learned entry is held to what holds its source today (issue 48, finding 2): a snapshot that
may continue a bundle records that bundle's manifest digest, and is restored and served only
while that very manifest is mounted and trusted; an older snapshot that lacks the record cannot
prove its source and is dropped (pipeline.runtime.snapshots, snapshot_restore)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from test_snapshots import host, prefilled  # noqa: F401 - host: fixture

from pipeline.format.bundle_folder import MANIFEST_FILE, SIGNATURE_FILE, SUMS_FILE, sums_text
from pipeline.format.bundle_signature import trusted_comment
from pipeline.format.fingerprint import sha256_bytes
from pipeline.format.manifest import Manifest
from pipeline.format.secret_key import generate
from pipeline.format.signature import read_trusted_keys
from pipeline.runtime import mount
from pipeline.runtime.snapshot_key import host_key
from pipeline.runtime.snapshot_store import SET_MARK, Entry
from pipeline.runtime.snapshots import DEFAULT_BUDGET, Snapshots

pytestmark = pytest.mark.usefixtures("host")
ELSEWHERE = [(11 * i + 5) % 700 + 30 for i in range(120)]  # opens with no bundle's token


def serving(root: Path, model: Path, bundles: Path, keys: tuple = (), caplog=None) -> Snapshots:
    """What serve does at a start: mount the bundles (refused ones skipped), then restore."""
    result = mount(model, bundles, skip_refused=True, trusted_keys=keys)
    snaps = Snapshots(root, DEFAULT_BUDGET, model, None, "mlx-lm")
    snaps.trust(lambda: result.bundles)
    snaps.restore([b.tokens for b in result.bundles])
    snaps.result = result
    return snaps


def continuing(bundle_tokens: list[int], model: Path) -> Entry:
    tokens = [*bundle_tokens, *range(40, 60)]
    return Entry(tokens, prefilled(model, tokens), "test", False)


@pytest.fixture
def deployed(tmp_path: Path, shop_bundle: Path) -> Path:
    bundles = tmp_path / "bundles"
    shutil.copytree(shop_bundle.parent.parent.parent, bundles)
    return bundles


def first_run(tmp_path: Path, model: Path, bundles: Path) -> tuple[list[int], Snapshots]:
    """An unsigned bundle served without --trusted-key, one conversation continued from it and
    one that opens elsewhere, saved at the stop."""
    snaps = serving(tmp_path / "snaps", model, bundles)
    (bundle,) = snaps.result.bundles
    entries = [
        continuing(bundle.tokens, model),
        Entry(ELSEWHERE, prefilled(model, ELSEWHERE), "t", False),
    ]
    snaps.save([(2, entries[0]), (1, entries[1])], lambda ids: 0)
    snaps.close()
    return entries[0].tokens, snaps


def saved(root: Path) -> dict[int, dict]:
    (folder,) = sorted(p for p in root.iterdir() if p.name.startswith("set-"))
    return {
        len(json.loads((p / MANIFEST_FILE).read_text())["snapshot"]["depends_on"]): json.loads(
            (p / MANIFEST_FILE).read_text()
        )
        for p in folder.iterdir()
        if p.name != SET_MARK
    }


def test_a_snapshot_records_the_digest_of_the_bundle_it_continues(
    tmp_path: Path, tiny_model: Path, deployed: Path
):
    first_run(tmp_path, tiny_model, deployed)
    (folder,) = (deployed / "shop" / "1").iterdir()
    digest = sha256_bytes((folder / MANIFEST_FILE).read_bytes())
    manifests = saved(tmp_path / "snaps")
    assert manifests[1]["format_version"] == 4
    assert manifests[1]["snapshot"]["depends_on"] == [
        {"bundle": "shop@1", "manifest_sha256": digest}
    ]
    assert manifests[0]["snapshot"]["depends_on"] == []  # computed by the server from token 0


def test_a_snapshot_of_a_bundle_trusted_no_more_is_not_served_after_the_restart(
    tmp_path: Path, tiny_model: Path, deployed: Path, caplog
):
    tokens, _ = first_run(tmp_path, tiny_model, deployed)
    secret = generate()
    (tmp_path / "k.pub").write_text(secret.public_key().file_text())
    keys = read_trusted_keys([tmp_path / "k.pub"])
    with caplog.at_level(logging.INFO, logger="prefix-bundles"):
        snaps = serving(tmp_path / "snaps", tiny_model, deployed, keys)
    assert snaps.result.bundles == []  # --trusted-key refuses the unsigned bundle now
    assert snaps.covered([*tokens, 7]) == 0 and snaps.fetch([*tokens, 7], 0)[0] is None
    assert snaps.covered([*ELSEWHERE, 7]) == len(ELSEWHERE)  # its own work stays
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 1 and dropped[0].endswith(
        "it continues bundle shop@1 (manifest sha256 "
        f"{saved(tmp_path / 'snaps')[1]['snapshot']['depends_on'][0]['manifest_sha256'][:16]}..), "
        "which is not mounted and trusted now (refused, removed, or replaced by another build); "
        "not restored"
    )
    assert (
        "restored 1 of 2" in caplog.text and "1 continuing a bundle not mounted now" in caplog.text
    )


def test_a_snapshot_of_a_removed_or_rebuilt_bundle_is_not_served(
    tmp_path: Path, tiny_model: Path, deployed: Path
):
    tokens, _ = first_run(tmp_path, tiny_model, deployed)
    (folder,) = (deployed / "shop" / "1").iterdir()
    data = json.loads((folder / MANIFEST_FILE).read_text())
    data["fidelity"]["probe"] = "another build of the same version"  # another manifest digest
    raw = (json.dumps(data, sort_keys=True, indent=2) + "\n").encode()
    (folder / MANIFEST_FILE).write_bytes(raw)
    sums = (
        (folder / SUMS_FILE)
        .read_text()
        .replace(
            saved(tmp_path / "snaps")[1]["snapshot"]["depends_on"][0]["manifest_sha256"],
            sha256_bytes(raw),
        )
    )
    (folder / SUMS_FILE).write_text(sums)
    snaps = serving(tmp_path / "snaps", tiny_model, deployed)
    assert [b.name for b in snaps.result.bundles] == ["shop@1"]  # mounted, but not that one
    assert snaps.covered([*tokens, 7]) == 0
    snaps.close()
    shutil.rmtree(deployed / "shop")
    snaps = serving(tmp_path / "snaps", tiny_model, deployed)
    assert snaps.covered([*tokens, 7]) == 0 and snaps.covered([*ELSEWHERE, 7]) == len(ELSEWHERE)


def test_a_chain_and_a_remount_are_held_to_the_bundle_too(
    tmp_path: Path, tiny_model: Path, deployed: Path, caplog
):
    tokens, _ = first_run(tmp_path, tiny_model, deployed)
    snaps = serving(tmp_path / "snaps", tiny_model, deployed)  # the same bundle: served
    assert snaps.covered([*tokens, 7]) == len(tokens)
    longer = [*tokens, *range(70, 90)]
    assert snaps.fetch(longer, 0)[0] is not None  # a request continues the snapshot
    snaps.save(
        [(snaps.tick(), Entry(longer, prefilled(tiny_model, longer), "t", False))], lambda i: 0
    )
    snaps.close()
    assert "shop@1" in json.dumps(saved(tmp_path / "snaps"))
    snaps = serving(tmp_path / "snaps", tiny_model, deployed)
    assert snaps.covered([*longer, 7]) == len(longer)
    snaps.result.bundles.clear()  # a remount removed the bundle while serving
    with caplog.at_level(logging.INFO, logger="prefix-bundles"):
        assert snaps.covered([*longer, 7]) == 0 and snaps.fetch([*longer, 7], 0)[0] is None
    assert (
        "is no longer served: it continues bundle shop@1, which is not mounted now" in caplog.text
    )
    snaps.save([], lambda ids: 0)  # nothing continuing it is saved either
    snaps.close()
    snaps = serving(tmp_path / "snaps", tiny_model, deployed)
    assert snaps.covered([*longer, 7]) == 0 and snaps.covered([*tokens, 7]) == 0


def test_an_older_snapshot_cannot_prove_its_source_and_is_dropped(
    tmp_path: Path, tiny_model: Path, deployed: Path, caplog
):
    first_run(tmp_path, tiny_model, deployed)
    (folder,) = sorted(p for p in (tmp_path / "snaps").iterdir() if p.name.startswith("set-"))
    for snap in (p for p in folder.iterdir() if p.name != SET_MARK):  # as format 3 wrote them
        data = json.loads((snap / MANIFEST_FILE).read_text())
        data["format_version"] = 3
        del data["snapshot"]["depends_on"]
        raw = (json.dumps(data, sort_keys=True, indent=2) + "\n").encode()
        (snap / MANIFEST_FILE).write_bytes(raw)
        sums = {
            k: v
            for v, k in (line.split("  ") for line in (snap / SUMS_FILE).read_text().splitlines())
        }
        sums[MANIFEST_FILE] = sha256_bytes(raw)
        (snap / SUMS_FILE).write_text(sums_text(sums))
        comment = trusted_comment(Manifest.model_validate_json(raw))
        (snap / SIGNATURE_FILE).write_bytes(host_key().sign(raw, comment).file_bytes())
    with caplog.at_level(logging.INFO, logger="prefix-bundles"):
        snaps = serving(tmp_path / "snaps", tiny_model, deployed)
    assert len(snaps) == 0 and "restored 0 of 2" in caplog.text
    assert (
        caplog.text.count(
            "written by an older release (format 3), which did not record the bundles it continues"
        )
        == 2
    )


def test_inspect_says_what_a_snapshot_depends_on(
    tmp_path: Path, tiny_model: Path, deployed: Path, capsys
):
    from pipeline.cli import main

    first_run(tmp_path, tiny_model, deployed)
    (folder,) = sorted(p for p in (tmp_path / "snaps").iterdir() if p.name.startswith("set-"))
    digest = saved(tmp_path / "snaps")[1]["snapshot"]["depends_on"][0]["manifest_sha256"]
    lines = []
    for snap in sorted(p for p in folder.iterdir() if p.name != SET_MARK):
        capsys.readouterr()
        main(["inspect", str(snap), "--model", str(tiny_model)])
        lines += [
            line.strip() for line in capsys.readouterr().out.splitlines() if "depends on" in line
        ]
    assert lines == [
        f"depends on:shop@1 (manifest sha256 {digest[:16]}..): restored only while each is "
        "mounted and trusted",
        "depends on:no bundle (the server computed it from token 0)",
    ]
