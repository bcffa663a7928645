"""A whole fleet's repository pulled through a real OCI registry on loopback (Debian's
docker-registry): after one version bump only the new blocks move, whatever else the same pull
takes and in whatever order; an unchanged bundle moves no blob and is up to date."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from registry_env import registry
from test_oci import no_docker_config  # noqa: F401 (autouse: no credentials, no backoff)

from pipeline.cli import main
from pipeline.cli.reports import PullReport, PushReport
from pipeline.distribute.artifact import parse_manifest, tag_of
from pipeline.distribute.blocks import read_layout
from pipeline.distribute.oci import Registry as Client
from pipeline.distribute.oci import parse_repo
from pipeline.format.bundle_folder import CACHE_FILE, read_manifest

from conftest import SYSTEM, build_bundle, document, write_definition

MORE = " Returns are accepted within thirty days with the receipt; gift cards are final."
TAIL = " ".join(["The front desk opens at nine and closes at five on weekdays."] * 3)
OTHER = " ".join(["You answer questions about the staff handbook, citing its sections."] * 6)


def define(root: Path, model: Path, name: str, text: str, version: int = 1) -> None:
    """prefixes/<name>.toml whose system text is `text` (no tools: the text comes first)."""
    toml = write_definition(root, model, name)
    body = toml.read_text().replace(f'tools_file = "{name}/tools.json"\n', "")
    body = body.replace("version = 1", f"version = {version}")
    toml.write_text(body.replace(json.dumps(SYSTEM), json.dumps(text)))


def pull(repo: str, model: Path, capsys) -> PullReport:
    assert main(["pull", "--repo", repo, "--model", str(model), "--json"]) == 0
    return document(PullReport, capsys.readouterr().out)


def test_a_fleet_pull_after_one_bump_moves_only_the_new_blocks_then_nothing(
    tmp_path: Path, tiny_model: Path, capsys
):
    """support-agent continues support@1 (it shares its first half) and its tag sorts before
    support's, so the whole pull compares its blocks with support/1's file before support@2's,
    which shares nearly all of support@1."""
    root, half = tmp_path / "project", " ".join([SYSTEM] * 8)
    base = f"{half} {half}"
    define(root, tiny_model, "support", base)
    define(root, tiny_model, "docqa", OTHER)
    first = [build_bundle(root, "support", check=False)]
    define(root, tiny_model, "support-agent", f"{half} {TAIL}")
    first += [build_bundle(root, n, check=False) for n in ("support-agent", "docqa")]
    assert read_manifest(first[1], None).parent.prefix == "support"
    model = Path(shutil.copytree(tiny_model, tmp_path / "deploy" / "tiny"))
    with registry(tmp_path / "registry") as reg:
        assert main(["push", *map(str, first), "--repo", reg.repo()]) == 0
        capsys.readouterr()
        first_pull = pull(reg.repo(), model, capsys)
        assert [b.status for b in first_pull.bundles] == ["pulled"] * 3
        # support@1 takes the blocks it shares with support-agent@1 (pulled first) from the
        # file this pull rebuilt: each blob the registry holds moved once
        assert first_pull.transfer.moved_bytes == reg.stored_bytes()
        assert first_pull.transfer.reused_blobs > 0

        define(root, tiny_model, "support", base + MORE, version=2)
        v2 = build_bundle(root, "support", check=False)
        assert main(["push", str(v2), "--repo", reg.repo(), "--json"]) == 0
        pushed = document(PushReport, capsys.readouterr().out).bundles[0]
        client = Client(parse_repo(reg.repo()))
        try:
            body, _ = client.get_manifest(tag_of("support", 2, v2.name))
        finally:
            client.close()
        parsed = parse_manifest(body, "test")
        plan = read_layout(v2 / CACHE_FILE, pushed.tokens)
        whole = read_manifest(v2, None).parent.reused_tokens // plan.block_tokens
        new = sum(b.size for b in parsed.blocks[whole:])
        small = pushed.bytes - sum(b.size for b in parsed.blocks)  # files, header, rest, config
        assert whole > 0 and new < 0.2 * pushed.bytes

        doc = pull(reg.repo(), model, capsys)
        status = {b.repo_path.split("/")[0]: (b.status, b.transfer) for b in doc.bundles}
        assert status["support"][0] == "pulled" and status["support"][1].moved_bytes == new + small
        assert status["support"][1].reused_blobs == whole
        looked = 0  # an unchanged bundle: only its artifact manifest is read, to compare
        for name in ("docqa", "support-agent"):
            assert status[name][0] == "up-to-date"
            assert (status[name][1].moved_blobs, status[name][1].reused_blobs) == (0, 0)
            looked += status[name][1].moved_bytes
        assert 0 < looked < 8 << 10
        assert doc.transfer.moved_bytes == new + small + looked
        local = model / "prefix-bundles" / "support" / "2" / v2.name
        assert (local / CACHE_FILE).read_bytes() == (v2 / CACHE_FILE).read_bytes()

        again = pull(reg.repo(), model, capsys)
        assert {b.status for b in again.bundles if b.version != 1 or b.prefix != "support"} == {
            "up-to-date"
        }
        assert again.transfer.moved_blobs == 0
        assert again.transfer.moved_bytes < looked + len(body) + 1
        assert main(["pull", "--repo", reg.repo(), "--model", str(model)]) == 0
        out = capsys.readouterr().out
        assert f"up to date support@2 ({pushed.tokens} tokens) at {local}" in out
        assert "no blob downloaded" in out
