"""`inspect` of one snapshot (DIR/set-N/<rank>-<id>): checked as a snapshot, everything but its
host signature, and it says that the host key was not read."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_snapshots import host, save_one  # noqa: F401 - host: the fixture used below

from pipeline.cli import main

pytestmark = pytest.mark.usefixtures("host")
NO_HOST_KEY = (
    "not checked: a snapshot is signed with its host's snapshot key, which inspect does not read "
    "(serve mounts it only where that key verifies it: docs/signing.md)"
)


def test_inspect_checks_a_snapshot_as_one_and_says_the_host_key_was_not_read(
    tmp_path: Path, tiny_model: Path, capsys
):
    folder = save_one(tmp_path / "snaps", tiny_model)
    assert main(["inspect", str(folder), "--model", str(tiny_model)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"snapshot {folder}"
    assert f"  --   signature             {NO_HOST_KEY}" in out
    assert "  FAIL" not in "\n".join(out)
    assert out[-2] == f"valid for {tiny_model}, host signature not checked: yes"
    assert out[-1] == (
        f"next: serve restores it on its host: prefix-bundles serve --model {tiny_model} "
        f"--snapshots {tmp_path / 'snaps'}"
    )


def test_inspect_json_of_a_damaged_snapshot(tmp_path: Path, tiny_model: Path, capsys):
    import json

    folder = save_one(tmp_path / "snaps", tiny_model)
    data = (folder / "cache.safetensors").read_bytes()
    (folder / "cache.safetensors").write_bytes(data[:-1000])
    assert main(["inspect", str(folder), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["kind"] == "snapshot" and report["validity"]["valid"] is False
    checks = {c["name"]: c for c in report["validity"]["checks"]}
    assert checks["signature"] == {"name": "signature", "status": "skipped", "detail": NO_HOST_KEY}
    assert checks["cache file"]["status"] == "failed"
    assert "(truncated or replaced)" in checks["cache file"]["detail"]
