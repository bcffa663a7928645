"""push / pull through a real OCI registry on loopback (Debian's docker-registry, distribution
2.8.2): round trip, only new blocks move, tampering, a swapped tag, an interrupted pull, auth.

Nothing is faked but a broken connection: the registry, the validator, the staging folder and the
atomic publish are the real ones.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest
from fuzz_corpus import reseal_sums
from registry_env import Registry, corrupt, registry

from pipeline.builder.signing import sign_bundle
from pipeline.cli import main
from pipeline.cli.reports import PullReport, PushReport
from pipeline.distribute import oci
from pipeline.distribute.artifact import BLOCK_TYPE, parse_manifest, tag_of
from pipeline.distribute.blocks import read_layout
from pipeline.distribute.oci import Registry as Client
from pipeline.distribute.oci import parse_repo
from pipeline.distribute.oci_http import httpx
from pipeline.format.bundle_folder import CACHE_FILE
from pipeline.format.secret_key import generate
from pipeline.runtime import mount

from conftest import SYSTEM, build_bundle, document, write_definition

MORE = " Returns are accepted within thirty days with the receipt; gift cards are final."


@pytest.fixture
def reg(tmp_path: Path):
    with registry(tmp_path / "registry") as r:
        yield r


@pytest.fixture
def model(tmp_path: Path, tiny_model: Path) -> Path:
    """A deployable copy of the tiny model (pull writes into <model>/prefix-bundles)."""
    return Path(shutil.copytree(tiny_model, tmp_path / "deploy" / "tiny"))


@pytest.fixture(autouse=True)
def no_docker_config(tmp_path: Path, monkeypatch):
    """No credentials from this machine's ~/.docker or environment."""
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker-config"))
    monkeypatch.delenv("PREFIX_BUNDLES_REGISTRY_USER", raising=False)
    monkeypatch.delenv("PREFIX_BUNDLES_REGISTRY_PASSWORD", raising=False)
    monkeypatch.setattr(oci, "BACKOFF_S", 0.0)


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def published(model: Path) -> list[str]:
    root = model / "prefix-bundles"
    return sorted(str(p.relative_to(root)) for p in root.glob("[!.]*/*/*")) if root.exists() else []


def artifact(reg: Registry, bundle: Path):
    """The artifact manifest the registry holds for a local bundle."""
    name, version = bundle.parent.parent.name, int(bundle.parent.name)
    client = Client(parse_repo(reg.repo()))
    try:
        body, _ = client.get_manifest(tag_of(name, version, bundle.name))
    finally:
        client.close()
    return parse_manifest(body, "test")


def test_push_then_pull_round_trip_is_byte_identical_and_mounts(
    reg: Registry, shop_bundle: Path, model: Path, capsys
):
    assert main(["push", str(shop_bundle), "--repo", reg.repo(), "--json"]) == 0
    pushed = document(PushReport, capsys.readouterr().out)
    (b,) = pushed.bundles
    assert (b.status, b.tag, pushed.revision, pushed.commit) == (
        "pushed",
        f"shop.V1.{shop_bundle.name}",
        None,
        None,
    )
    t = pushed.transfer
    assert t.reused_bytes == 0 and t.moved_bytes == b.bytes
    # the registry's storage grew by what the client reported (blobs and the manifest)
    assert reg.stored_bytes() == t.moved_bytes
    parsed = artifact(reg, shop_bundle)
    plan = read_layout(shop_bundle / CACHE_FILE, b.tokens)
    assert len(parsed.blocks) == plan.blocks == -(-b.tokens // plan.block_tokens) > 1
    assert {f.title for f in parsed.files} == set(files_of(shop_bundle)) - {CACHE_FILE}

    # pushing it again moves no blob
    assert main(["push", str(shop_bundle), "--repo", reg.repo(), "--json"]) == 0
    again = document(PushReport, capsys.readouterr().out)
    assert again.transfer.moved_blobs == 0  # only the manifest is put again
    assert again.transfer.moved_bytes + again.transfer.reused_bytes == t.moved_bytes
    assert again.bundles[0].digest == b.digest

    assert main(["pull", "--repo", reg.repo(), "--model", str(model), "--json"]) == 0
    doc = document(PullReport, capsys.readouterr().out)
    local = model / "prefix-bundles" / "shop" / "1" / shop_bundle.name
    assert [(x.status, x.path, x.digest) for x in doc.bundles] == [("pulled", str(local), b.digest)]
    assert doc.transfer.moved_bytes == b.bytes and doc.transfer.reused_bytes == 0
    assert files_of(local) == files_of(shop_bundle)
    assert [x.name for x in mount(model).bundles] == ["shop@1"]

    # pulled again: the bundle here is the artifact's, up to date, and no blob moves
    assert main(["pull", "--repo", reg.repo(), "--model", str(model)]) == 0
    out = capsys.readouterr().out
    assert f"up to date shop@1 ({b.tokens} tokens) at {local} ({b.digest})" in out
    assert "no blob downloaded" in out
    assert files_of(local) == files_of(shop_bundle)


def test_a_tampered_block_in_the_registry_is_one_error_and_nothing_is_published(
    reg: Registry, shop_bundle: Path, model: Path, capsys
):
    assert main(["push", str(shop_bundle), "--repo", reg.repo()]) == 0
    block = artifact(reg, shop_bundle).blocks[1]
    corrupt(reg.blob_file(block.digest))
    capsys.readouterr()
    assert main(["pull", "--repo", reg.repo(), "--model", str(model)]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"error: registry {reg.host}: blob {block.digest} of fleet/bundles is not what its "
        f"manifest lists (got {block.size:,} bytes, {err.split('bytes, ')[1][:21]}, expected "
        f"{block.size:,} bytes): the registry's copy is damaged or was altered; push the bundle "
        "again. Nothing was published\n"
    )
    assert published(model) == []
    # what arrived is kept to resume from: each block is checked by digest again then
    assert {p.name for p in (model / "prefix-bundles" / ".staging").iterdir()} <= {
        "locks",
        "resume",
    }


def as_format_3(shop_bundle: Path, root: Path) -> Path:
    """The shop bundle as a format-3 builder wrote it (no cache.blocks), at root/shop/1/<folder>,
    SHA256SUMS recomputed: its file is proven whole, by the BLAKE3 its manifest pins."""
    bundle = Path(shutil.copytree(shop_bundle, root / "shop" / "1" / shop_bundle.name))
    raw = json.loads((bundle / "manifest.json").read_text())
    raw["format_version"] = 3
    del raw["cache"]["blocks"]
    (bundle / "manifest.json").write_text(json.dumps(raw, sort_keys=True, indent=2) + "\n")
    reseal_sums(bundle)
    return bundle


def remake_block(reg: Registry, bundle: Path) -> str:
    """Someone with push rights swaps block 1 for other bytes and re-points the tag at an
    artifact listing the new block's true digest (every blob checks out against its listing);
    the new block's digest."""
    import hashlib

    name, version = bundle.parent.parent.name, int(bundle.parent.name)
    tag = tag_of(name, version, bundle.name)
    client = Client(parse_repo(reg.repo()))
    try:
        body, _ = client.get_manifest(tag)
        doc = json.loads(body)
        blocks = [d for d in doc["layers"] if d["mediaType"] == BLOCK_TYPE]
        old = blocks[1]
        data = bytearray(client.get_blob(old["digest"], old["size"]))
        data[100] ^= 0x01
        new = "sha256:" + hashlib.sha256(data).hexdigest()
        client.upload(new, bytes(data))
        old["digest"] = new
        client.put_manifest(tag, json.dumps(doc).encode())
    finally:
        client.close()
    return new


def test_a_re_made_artifact_whose_blocks_are_not_the_signed_cache_is_refused(
    reg: Registry, shop_bundle: Path, model: Path, tmp_path: Path, capsys
):
    """A format-3 bundle (no block pins): every blob checks out against its listing, the rebuilt
    file does not match the BLAKE3 manifest.json pins, and nothing is published."""
    bundle = as_format_3(shop_bundle, tmp_path / "older")
    assert main(["push", str(bundle), "--repo", reg.repo()]) == 0
    remake_block(reg, bundle)
    capsys.readouterr()
    assert main(["pull", "--repo", reg.repo(), "--model", str(model)]) == 1
    err = capsys.readouterr().err
    pinned = json.loads((shop_bundle / "manifest.json").read_text())["cache"]["file_blake3"]
    assert err.startswith(
        f"error: bundle shop/1/{shop_bundle.name} from registry repo {reg.repo()}: "
        f"cache.safetensors blake3 mismatch (expected {pinned[:12]}.., found "
    )
    assert err.endswith(
        "..); the file is corrupt or was edited: rebuild it or copy it again (nothing was "
        "published)\n"
    )
    assert err.count("\n") == 1
    assert published(model) == []


def test_a_re_made_block_is_refused_against_the_manifests_pins_before_any_block_moves(
    reg: Registry, shop_bundle: Path, model: Path, capsys
):
    """Format 5: manifest.json pins every block (cache.blocks), so the re-made artifact is
    refused when its listing is read, with no block downloaded (the format-3 bundle above is
    refused only after the whole download, at the BLAKE3 check)."""
    assert main(["push", str(shop_bundle), "--repo", reg.repo()]) == 0
    pinned = artifact(reg, shop_bundle).blocks[1].digest
    new = remake_block(reg, shop_bundle)
    capsys.readouterr()
    assert main(["pull", "--repo", reg.repo(), "--model", str(model), "--json"]) == 1
    captured = capsys.readouterr()
    tag = tag_of("shop", 1, shop_bundle.name)
    assert captured.err == (
        f"error: bundle shop/1/{shop_bundle.name} from registry repo {reg.repo()} (tag {tag}): "
        f"its block 1 is {new[:19]}, its manifest.json pins {pinned[:19]} (cache.blocks): the "
        "artifact was re-made or altered; push the bundle again; nothing was published\n"
    )
    assert published(model) == []
    staged = model / "prefix-bundles" / ".staging"
    assert not any(staged.glob("**/cache.safetensors"))  # no block was written anywhere


def test_a_pull_proves_each_block_as_it_lands_and_does_not_read_the_file_again(
    reg: Registry, shop_bundle: Path, model: Path, tmp_path: Path, monkeypatch
):
    """The validator's data stage hashes nothing for a format-5 file whose every piece the pull
    proved (read_data is asked for no digest), and a format-3 file is read once for its BLAKE3."""
    from pipeline.format import validate as validate_module

    asked: list[tuple[str, ...]] = []
    real = validate_module.read_data

    def spy(f, header, *, digests, load):
        asked.append(tuple(digests))
        return real(f, header, digests=digests, load=load)

    monkeypatch.setattr(validate_module, "read_data", spy)
    older = as_format_3(shop_bundle, tmp_path / "older")
    for bundle, expected in ((shop_bundle, ()), (older, ("blake3",))):
        repo = reg.repo(f"fleet/f{len(asked)}")
        assert main(["push", str(bundle), "--repo", repo]) == 0
        asked.clear()
        target = Path(shutil.copytree(model, tmp_path / f"m{len(expected)}"))
        assert main(["pull", "--repo", repo, "--model", str(target)]) == 0
        assert asked == [expected]
        local = target / "prefix-bundles" / "shop" / "1" / shop_bundle.name
        assert files_of(local) == files_of(bundle)


def test_a_swapped_tag_is_one_error_and_nothing_is_published(
    reg: Registry, shop_bundle: Path, model: Path, capsys
):
    """shop@1's artifact put under shop@2's tag: the config names another bundle."""
    assert main(["push", str(shop_bundle), "--repo", reg.repo()]) == 0
    client = Client(parse_repo(reg.repo()))
    body, _ = client.get_manifest(tag_of("shop", 1, shop_bundle.name))
    client.put_manifest(tag_of("shop", 2, shop_bundle.name), body)
    client.close()
    capsys.readouterr()
    assert main(["pull", "--repo", reg.repo(), "--model", str(model)]) == 1
    err = capsys.readouterr().err
    tag = f"shop.V2.{shop_bundle.name}"
    assert err == (
        f"error: bundle shop/2/{shop_bundle.name} from registry repo {reg.repo()} (tag {tag}): "
        f"the tag points at the artifact of shop/1/{shop_bundle.name} (a swapped or re-pointed "
        "tag); push the bundle again; nothing was published\n"
    )
    assert published(model) == []


def test_an_interrupted_pull_publishes_nothing_and_the_next_one_resumes(
    reg: Registry, shop_bundle: Path, model: Path, capsys, monkeypatch
):
    """The line breaks in the middle of the first block (the retry asks for the rest with a
    Range request: no byte twice), then stays down at the last block: nothing is published. The
    next pull downloads only the last block: the others are taken from the partial file, each
    checked by digest."""
    assert main(["push", str(shop_bundle), "--repo", reg.repo(), "--json"]) == 0
    total = document(PushReport, capsys.readouterr().out).bundles[0].bytes
    parsed = artifact(reg, shop_bundle)
    first, last = parsed.blocks[0], parsed.blocks[-1]
    real, calls = Client._blob_chunks, []

    def breaks(self, digest, size, doing, start=0):
        calls.append((digest, start))
        if digest == last.digest:
            raise httpx.ReadError("connection reset by peer")
        sent = 0  # the line breaks once half the first block has come, in whatever pieces
        for chunk in real(self, digest, size, doing, start):
            if digest == first.digest and start == 0 and sent + len(chunk) >= size // 2:
                yield chunk[: size // 2 - sent]
                raise httpx.ReadError("connection reset by peer")
            sent += len(chunk)
            yield chunk

    monkeypatch.setattr(Client, "_blob_chunks", breaks)
    assert main(["pull", "--repo", reg.repo(), "--model", str(model)]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"error: registry {reg.host}: downloading blob {last.digest[:19]} ({last.size:,} "
        "bytes) failed after 4 tries (the connection broke); pull again to resume: nothing was "
        "published\n"
    )
    assert [c for c in calls if c[0] == first.digest] == [
        (first.digest, 0),
        (first.digest, first.size // 2),  # the rest of the block, not the block again
    ]
    assert published(model) == []
    assert {p.name for p in (model / "prefix-bundles" / ".staging").iterdir()} <= {
        "locks",
        "resume",
    }

    calls.clear()
    monkeypatch.setattr(Client, "_blob_chunks", real)
    monkeypatch.setattr(Client, "_blob_chunks", lambda *a: (calls.append(a[1]), real(*a))[1])
    assert main(["pull", "--repo", reg.repo(), "--model", str(model), "--json"]) == 0
    t = document(PullReport, capsys.readouterr().out).transfer
    assert {b.digest for b in parsed.blocks} & set(calls) == {last.digest}
    assert (t.reused_blobs, t.reused_bytes) == (
        len(parsed.blocks),  # the rest blob and every block but the last
        total - t.moved_bytes,
    )
    assert t.moved_bytes < total - sum(b.size for b in parsed.blocks[:-1])
    local = model / "prefix-bundles" / "shop" / "1" / shop_bundle.name
    assert files_of(local) == files_of(shop_bundle)
    assert not (model / "prefix-bundles" / ".staging" / "resume").exists()


def test_a_block_missing_from_the_registry_is_one_error_and_nothing_is_published(
    reg: Registry, shop_bundle: Path, model: Path, capsys
):
    assert main(["push", str(shop_bundle), "--repo", reg.repo()]) == 0
    block = artifact(reg, shop_bundle).blocks[1]
    shutil.rmtree(reg.blob_file(block.digest).parent)  # the storage lost it
    capsys.readouterr()
    assert main(["pull", "--repo", reg.repo(), "--model", str(model)]) == 1
    assert capsys.readouterr().err == (
        f"error: registry {reg.host}: blob {block.digest} of fleet/bundles is missing (HTTP 404 "
        "(BLOB_UNKNOWN: blob unknown to registry)): the artifact lists it, the registry lost it "
        "(deleted, or garbage-collected while still listed); push the bundle again. Nothing was "
        "published\n"
    )
    assert published(model) == []
    # a push finds it missing and uploads it again; then the pull completes
    assert main(["push", str(shop_bundle), "--repo", reg.repo()]) == 0
    assert main(["pull", "--repo", reg.repo(), "--model", str(model)]) == 0
    assert published(model) == [f"shop/1/{shop_bundle.name}"]


def test_a_manifest_over_the_registry_limit_is_refused(
    reg: Registry, shop_bundle: Path, model: Path, capsys, monkeypatch
):
    """Pull: a tag whose manifest in storage is over 4 MiB (written into the storage: the
    registry's PUT refuses it) is one line; docker-registry itself refuses to read it (HTTP 500,
    'storage: read exceeds limit'). A registry that serves one anyway is the next test. Push: an
    artifact whose manifest would be over the limit (here lowered to 2,000 bytes: a real one
    needs ~25,000 blocks) is refused before any blob is uploaded."""
    assert main(["push", str(shop_bundle), "--repo", reg.repo()]) == 0
    tag = tag_of("shop", 1, shop_bundle.name)
    client = Client(parse_repo(reg.repo()))
    body = json.loads(client.get_manifest(tag)[0])
    client.close()
    body["annotations"]["padding"] = "x" * (5 << 20)
    reg.store_manifest(tag, json.dumps(body).encode())
    capsys.readouterr()
    assert main(["pull", "--repo", reg.repo(), "--model", str(model)]) == 1
    assert capsys.readouterr().err == (
        f"error: registry {reg.host}: reading manifest {tag} failed after 4 tries (HTTP 500 "
        "(UNKNOWN: unknown error)); check that the registry is up and reachable, then retry\n"
    )
    assert published(model) == []

    monkeypatch.setattr(oci, "MAX_MANIFEST_BYTES", 2000)
    other = reg.repo("fleet/other")
    assert main(["push", str(shop_bundle), "--repo", other]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: bundle shop/1/{shop_bundle.name}: its artifact manifest ")
    assert err.endswith(
        " over the 2,000 a registry accepts; nothing was uploaded: split the prefix into smaller "
        "ones\n"
    ) and err.count("\n") == 1  # fmt: skip
    assert not (reg.storage / "docker/registry/v2/repositories/fleet/other").exists()


def test_a_registry_serving_an_oversize_manifest_is_read_no_further_than_the_limit(
    model: Path, capsys
):
    """A loopback server answering every manifest with 64 MiB (a hostile or broken registry):
    the pull stops reading past 4 MiB and says so in one line."""
    import http.server
    import threading

    sent = []

    class Huge(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if "/tags/list" in self.path:
                body = json.dumps({"tags": [f"shop.V1.{model.name}-c01d20cbb3fb"]}).encode()
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.send_response(200)
            self.send_header("content-length", str(64 << 20))
            self.end_headers()
            sent.append(0)
            try:
                for _ in range(1024):
                    self.wfile.write(b" " * (64 << 10))
                    sent[-1] += 64 << 10
            except OSError:
                pass

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Huge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host = f"127.0.0.1:{server.server_address[1]}"
    try:
        assert main(["pull", "--repo", f"oci://{host}/fleet/bundles", "--model", str(model)]) == 1
    finally:
        server.shutdown()
        server.server_close()
    tag = f"shop.V1.{model.name}-c01d20cbb3fb"
    assert capsys.readouterr().err == (
        f"error: registry {host}: manifest {tag} of fleet/bundles is over 4,194,304 bytes, the "
        "most a registry accepts (the rest was not read): not an artifact this tool pushed; push "
        "the bundle again. Nothing was published\n"
    )
    assert len(sent) == 1 and sent[0] < 16 << 20  # of 64 MiB: the client hung up
    assert published(model) == []


def test_with_a_trusted_key_an_unsigned_bundle_is_refused_before_any_block_moves(
    reg: Registry, shop_bundle: Path, model: Path, tmp_path: Path, capsys, monkeypatch
):
    key = generate()
    pub = tmp_path / "release.pub"
    pub.write_text(key.public_key().file_text())
    assert main(["push", str(shop_bundle), "--repo", reg.repo()]) == 0
    blocks = {b.digest for b in artifact(reg, shop_bundle).blocks}
    fetched: list[str] = []
    real = Client.stream_blob
    monkeypatch.setattr(
        Client, "stream_blob", lambda self, d, n, sink: (fetched.append(d), real(self, d, n, sink))
    )
    capsys.readouterr()
    args = ["pull", "--repo", reg.repo(), "--model", str(model), "--trusted-key", str(pub)]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: bundle shop/1/{shop_bundle.name} from registry repo ")
    assert "manifest.json.minisig is missing" in err and err.count("\n") == 1
    assert ".staging" not in err and f"sign shop/1/{shop_bundle.name} --key" in err  # no temp path
    assert fetched and not blocks & set(fetched) and published(model) == []

    signed = tmp_path / "signed" / "shop" / "1" / shop_bundle.name
    shutil.copytree(shop_bundle, signed)
    sign_bundle(signed, key)
    assert main(["push", str(signed), "--repo", reg.repo()]) == 0
    assert main(args) == 0
    assert files_of(model / "prefix-bundles" / "shop" / "1" / shop_bundle.name) == files_of(signed)


def test_basic_auth_from_the_docker_config_and_a_wrong_password(
    tmp_path: Path, shop_bundle: Path, model: Path, capsys, monkeypatch
):
    with registry(tmp_path / "auth-registry", users={"ci": "s3cret-pass"}) as reg:
        assert main(["push", str(shop_bundle), "--repo", reg.repo()]) == 1
        assert capsys.readouterr().err == (
            f"error: registry {reg.host}: checking blob sha256:"
            f"{_first_digest(shop_bundle)}: not authorized (HTTP 401, without credentials); log "
            "in with 'docker login' (read from ~/.docker/config.json) or set "
            "PREFIX_BUNDLES_REGISTRY_USER and PREFIX_BUNDLES_REGISTRY_PASSWORD\n"
        )
        config = tmp_path / "docker"
        config.mkdir()
        auth = base64.b64encode(b"ci:s3cret-pass").decode()
        (config / "config.json").write_text(json.dumps({"auths": {reg.host: {"auth": auth}}}))
        monkeypatch.setenv("DOCKER_CONFIG", str(config))
        assert main(["push", str(shop_bundle), "--repo", reg.repo()]) == 0
        assert main(["pull", "--repo", reg.repo(), "--model", str(model)]) == 0
        capsys.readouterr()

        monkeypatch.setenv("PREFIX_BUNDLES_REGISTRY_USER", "ci")
        monkeypatch.setenv("PREFIX_BUNDLES_REGISTRY_PASSWORD", "wrong")
        assert main(["pull", "--repo", reg.repo(), "--model", str(model)]) == 1
        assert capsys.readouterr().err == (
            f"error: registry {reg.host}: listing tags: not authorized (HTTP 401, as 'ci'); log "
            "in with 'docker login' (read from ~/.docker/config.json) or set "
            "PREFIX_BUNDLES_REGISTRY_USER and PREFIX_BUNDLES_REGISTRY_PASSWORD\n"
        )


def _first_digest(bundle: Path) -> str:
    import hashlib

    return hashlib.sha256((bundle / "SHA256SUMS").read_bytes()).hexdigest()[:12]


def test_a_registry_that_is_down_is_one_line(shop_bundle: Path, capsys):
    from servers_env import free_port

    host = f"127.0.0.1:{free_port()}"
    assert main(["push", str(shop_bundle), "--repo", f"oci://{host}/fleet/bundles"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: registry {host}: checking blob sha256:")
    assert "failed after 4 tries (ConnectError" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "repo",
    ["oci://", "oci://host", "oci://host/UPPER/case", "oci://host/a//b"],
)
def test_a_bad_oci_repo_is_one_line(repo: str, shop_bundle: Path, capsys):
    assert main(["push", str(shop_bundle), "--repo", repo]) == 1
    assert capsys.readouterr().err == (
        f"error: --repo {repo!r} is not an OCI repository; pass it as "
        "oci://HOST[:PORT]/NAMESPACE/NAME (lower-case path components)\n"
    )


# --- a new version moves only its new blocks ------------------------------------------------------


def test_a_child_moves_only_its_new_blocks_each_way(
    reg: Registry, tmp_path: Path, tiny_model: Path, model: Path, capsys
):
    """At the default build settings: v2 appends a sentence (~2 % of its tokens) to a system
    text of ~900 tokens (no tools: the template puts them after the system text)."""
    root = tmp_path / "project"
    toml = write_definition(root, tiny_model)
    base = " ".join([SYSTEM] * 8)
    text = toml.read_text().replace('tools_file = "shop/tools.json"\n', "")
    toml.write_text(text.replace(json.dumps(SYSTEM), json.dumps(base)))
    v1 = build_bundle(root, check=False)
    toml.write_text(
        toml.read_text()
        .replace("version = 1", "version = 2")
        .replace(json.dumps(base), json.dumps(base + MORE))
    )
    v2 = build_bundle(root, check=False)
    from pipeline.format.bundle_folder import read_manifest

    shared = read_manifest(v2, None).parent.reused_tokens
    assert main(["push", str(v1), "--repo", reg.repo()]) == 0
    assert main(["pull", "--repo", reg.repo(), "--model", str(model)]) == 0
    capsys.readouterr()
    before = reg.stored_bytes()

    assert main(["push", str(v2), "--repo", reg.repo(), "--json"]) == 0
    pushed = document(PushReport, capsys.readouterr().out)
    parsed = artifact(reg, v2)
    plan = read_layout(v2 / CACHE_FILE, pushed.bundles[0].tokens)
    whole = shared // plan.block_tokens  # blocks below the shared token: the parent's bytes
    new_blocks = sum(b.size for b in parsed.blocks[whole:])
    per_token = sum(s.lead * s.row for s in plan.token_spans)
    assert new_blocks == (plan.tokens - whole * plan.block_tokens) * per_token
    others = pushed.bundles[0].bytes - sum(b.size for b in parsed.blocks)
    t = pushed.transfer
    assert t.reused_blobs == whole > 0
    assert t.moved_bytes == new_blocks + others
    assert reg.stored_bytes() - before == t.moved_bytes  # storage grew by what moved
    assert t.moved_bytes < 0.10 * pushed.bundles[0].bytes

    assert main(["pull", "--repo", reg.repo(), "--model", str(model), "--json"]) == 0
    pulled = document(PullReport, capsys.readouterr().out)
    assert pulled.transfer.reused_blobs == whole
    assert pulled.transfer.moved_bytes == t.moved_bytes
    local = model / "prefix-bundles" / "shop" / "2" / v2.name
    assert files_of(local) == files_of(v2)
    assert {p.media_type for p in parsed.blocks} == {BLOCK_TYPE}


def test_a_second_prefix_sharing_90_percent_moves_at_most_015_each_way(
    reg: Registry, tmp_path: Path, tiny_model: Path, model: Path, capsys
):
    """Another definition whose system text starts with the first one's (about 90 % of its
    tokens), built from it at the default settings: its push and its pull move only the blocks
    past the shared tokens (the registry and the server already hold the first prefix's). On this
    tiny bundle (~800 tokens) one 64-token block is ~8 % of its bytes, so the bound is 0.15 of
    them plus the one block the shared tokens end in."""
    from pipeline.format.bundle_folder import read_manifest

    root = tmp_path / "project"
    base = " ".join([SYSTEM] * 8)
    tail = " ".join(["The front desk opens at nine and closes at five on weekdays."] * 3)
    bundles = {}
    for name, text in (("shop", base), ("desk", base + " " + tail)):
        toml = write_definition(root, tiny_model, name)
        body = toml.read_text().replace(f'tools_file = "{name}/tools.json"\n', "")
        toml.write_text(body.replace(json.dumps(SYSTEM), json.dumps(text)))
        bundles[name] = build_bundle(root, name, check=False)
    desk = read_manifest(bundles["desk"], None)
    assert desk.parent is not None and desk.parent.prefix == "shop"
    share = desk.parent.reused_tokens / desk.tokens.count
    assert 0.85 <= share <= 0.95, share
    assert main(["push", str(bundles["shop"]), "--repo", reg.repo()]) == 0
    assert main(["pull", "--repo", reg.repo(), "--model", str(model)]) == 0
    capsys.readouterr()
    assert main(["push", str(bundles["desk"]), "--repo", reg.repo(), "--json"]) == 0
    pushed = document(PushReport, capsys.readouterr().out)
    bound = 0.15 * pushed.bundles[0].bytes + artifact(reg, bundles["desk"]).blocks[0].size
    assert pushed.transfer.moved_bytes <= bound
    assert main(["pull", "--repo", reg.repo(), "--model", str(model), "--json"]) == 0
    pulled = document(PullReport, capsys.readouterr().out)
    assert pulled.transfer.moved_bytes <= bound
    local = model / "prefix-bundles" / "desk" / "1" / bundles["desk"].name
    assert files_of(local) == files_of(bundles["desk"])


def test_push_dry_run_says_what_would_move_and_changes_nothing(
    reg: Registry, shop_bundle: Path, capsys
):
    before = reg.stored_bytes()
    assert main(["push", str(shop_bundle), "--repo", reg.repo(), "--dry-run", "--json"]) == 0
    dry = document(PushReport, capsys.readouterr().out)
    assert reg.stored_bytes() == before  # nothing uploaded
    assert dry.bundles[0].status == "skipped" and dry.transfer.reused_blobs == 0
    assert main(["push", str(shop_bundle), "--repo", reg.repo(), "--json"]) == 0
    real = document(PushReport, capsys.readouterr().out)
    assert real.transfer.moved_bytes == dry.transfer.moved_bytes  # it said what would move
    assert real.bundles[0].digest == dry.bundles[0].digest
    assert main(["push", str(shop_bundle), "--repo", reg.repo(), "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert " bytes would be uploaded in 0 blobs, " in out[-1]  # the manifest only: blobs are in


# --- progress ---------------------------------------------------------------------------------


def test_progress_is_plain_lines_off_a_terminal_and_nothing_under_json(
    reg: Registry, shop_bundle: Path, model: Path, capsys, monkeypatch
):
    """Off a terminal: a line when an artifact starts and one when it is in (plain lines start
    at 64 MiB and come at most every 2 s: both lowered or raised here for the tiny bundle)."""
    from pipeline.cli import push as cli_push

    monkeypatch.setattr(cli_push, "PLAIN_MIN_BYTES", 0)
    monkeypatch.setattr(cli_push, "PLAIN_EVERY_S", 1e9)
    assert main(["push", str(shop_bundle), "--repo", reg.repo()]) == 0
    push = capsys.readouterr().err.splitlines()
    assert main(["push", str(shop_bundle), "--repo", reg.repo("fleet/json"), "--json"]) == 0
    total = document(PushReport, capsys.readouterr().out).bundles[0].bytes
    assert main(["pull", "--repo", reg.repo(), "--model", str(model)]) == 0
    pull = capsys.readouterr().err.splitlines()
    assert main(["pull", "--repo", reg.repo(), "--model", str(model), "--json"]) == 0
    assert capsys.readouterr().err == ""  # --json: nothing but the document

    mib = f"{total / (1 << 20):,.1f}"
    for verb, lines in (("push", push), ("pull", pull)):
        assert len(lines) == 2 and lines[0] == f"{verb} shop@1: 0.0/{mib} MiB", lines
        assert lines[1].startswith(f"{verb} shop@1: {mib}/{mib} MiB, ")
        assert lines[1].endswith(" MiB/s, ETA 0.0s")


def test_transfer_text_counts_the_rate_over_what_moved():
    from pipeline.cli.push import transfer_text

    mib = 1 << 20
    assert transfer_text(0, 100 * mib, 0, 0.0) == "0.0/100.0 MiB"
    assert transfer_text(60 * mib, 100 * mib, 40 * mib, 2.0) == (
        "60.0/100.0 MiB (40.0 MiB already here), 10.0 MiB/s, ETA 4.0s"
    )


# --- bearer tokens ------------------------------------------------------------------------------


def test_bearer_token_auth_through_a_token_service(
    tmp_path: Path, shop_bundle: Path, model: Path, capsys, monkeypatch
):
    """The real registry configured for token auth (`auth: token`, trusting a test certificate)
    and a small loopback token service that signs JWTs with it: the client answers the 401's
    Bearer challenge with a token for the scope it names (pull, then pull,push), credentials
    from the environment; a wrong password is one line."""
    from registry_env import TokenService

    tokens = TokenService(tmp_path / "token", {"ci": "t0ken-pass"})
    with tokens.running(), registry(tmp_path / "token-registry", token=tokens) as reg:
        monkeypatch.setenv("PREFIX_BUNDLES_REGISTRY_USER", "ci")
        monkeypatch.setenv("PREFIX_BUNDLES_REGISTRY_PASSWORD", "t0ken-pass")
        assert main(["push", str(shop_bundle), "--repo", reg.repo()]) == 0
        assert main(["pull", "--repo", reg.repo(), "--model", str(model)]) == 0
        assert published(model) == [f"shop/1/{shop_bundle.name}"]
        scopes = {  # the registry names the actions in either order
            (s.rpartition(":")[0], frozenset(s.rpartition(":")[2].split(",")))
            for user, asked in tokens.requests
            for s in asked
            if user == "ci"
        }
        repo = "repository:fleet/bundles"
        assert scopes >= {(repo, frozenset({"pull"})), (repo, frozenset({"pull", "push"}))}
        capsys.readouterr()

        monkeypatch.setenv("PREFIX_BUNDLES_REGISTRY_PASSWORD", "wrong")
        assert main(["pull", "--repo", reg.repo(), "--model", str(model)]) == 1
        assert capsys.readouterr().err == (
            f"error: registry {reg.host}: listing tags: not authorized (HTTP 401, as 'ci'); log "
            "in with 'docker login' (read from ~/.docker/config.json) or set "
            "PREFIX_BUNDLES_REGISTRY_USER and PREFIX_BUNDLES_REGISTRY_PASSWORD\n"
        )


# --- deploys pinned by digest -------------------------------------------------------------------


def test_pull_lockfile_pins_by_the_digest_push_recorded(
    reg: Registry, shop_bundle: Path, model: Path, tmp_path: Path, capsys
):
    """push --lockfile records the artifact digest in the version's entry; pull --lockfile
    fetches that digest, whatever the tag points at now (here: another artifact of the same
    bundle, re-tagged after the release)."""
    from pipeline.format.lockfile import read_lock

    lockfile = tmp_path / "prefixes.lock"
    m = json.loads((shop_bundle / "manifest.json").read_text())
    entry = {"version": 1, "content_sha256": m["prefix"]["content_sha256"],
             "template_sha256": m["model"]["template_sha256"],
             "models": {shop_bundle.name: m["model"]["fingerprint"]}}  # fmt: skip
    lockfile.write_text(json.dumps({"lock_version": 1, "prefixes": {"shop": entry}}))
    args = ["push", str(shop_bundle), "--repo", reg.repo(), "--lockfile", str(lockfile)]
    assert main([*args, "--json"]) == 0
    digest = document(PushReport, capsys.readouterr().out).bundles[0].digest
    assert read_lock(lockfile).prefixes["shop"].artifacts == {shop_bundle.name: digest}

    tag = tag_of("shop", 1, shop_bundle.name)
    client = Client(parse_repo(reg.repo()))
    body = json.loads(client.get_manifest(tag)[0])
    body["annotations"]["re-tagged"] = "later"
    moved = client.put_manifest(tag, json.dumps(body).encode())
    client.close()
    assert moved != digest

    pull = ["pull", "--repo", reg.repo(), "--model", str(model), "--json"]
    assert main([*pull, "--lockfile", str(lockfile)]) == 0
    (b,) = document(PullReport, capsys.readouterr().out).bundles
    assert (b.status, b.digest) == ("pulled", digest)
    assert main(pull) == 0  # without the lockfile: the tag
    assert document(PullReport, capsys.readouterr().out).bundles[0].digest == moved

    assert main([*pull, "--lockfile", str(lockfile), "--prefix", "shop"]) == 1
    assert capsys.readouterr().err == (
        "error: --prefix and --lockfile both choose what to pull: pass one (the lockfile pins "
        "every prefix it locks for the model)\n"
    )
    (tmp_path / "v2.lock").write_text(lockfile.read_text().replace('"version": 1', '"version": 2'))
    other = reg.repo("fleet/other")
    assert (
        main(["push", str(shop_bundle), "--repo", other, "--lockfile", f"{tmp_path}/v2.lock"]) == 1
    )
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'v2.lock'}: it locks shop@2, not the pushed shop@1; push the "
        "bundles the lockfile names (build --locked), or drop --lockfile\n"
    )
    assert not (reg.storage / "docker/registry/v2/repositories/fleet/other").exists()  # first


def test_pull_rebuilds_with_the_block_size_the_artifact_records(
    reg: Registry, shop_bundle: Path, model: Path, tmp_path: Path, monkeypatch
):
    """A pusher whose rule gave 16-token blocks (here: its byte target lowered): for a format-3
    bundle the pull cuts with the size the artifact's config records, not its own rule's 64; a
    format-5 bundle is cut as its manifest.json pins (cache.blocks), whatever the pusher's rule."""
    from pipeline.format import cache_blocks

    older = as_format_3(shop_bundle, tmp_path / "older")
    with monkeypatch.context() as m:
        m.setattr(cache_blocks, "TARGET_BLOCK_BYTES", 1)
        assert main(["push", str(older), "--repo", reg.repo()]) == 0
        assert main(["push", str(shop_bundle), "--repo", reg.repo("fleet/v5")]) == 0
    tokens = json.loads((shop_bundle / "manifest.json").read_text())["tokens"]["count"]
    assert len(artifact(reg, older).blocks) == -(-tokens // 16) > -(-tokens // 64)
    assert main(["pull", "--repo", reg.repo(), "--model", str(model)]) == 0
    local = model / "prefix-bundles" / "shop" / "1" / shop_bundle.name
    assert files_of(local) == files_of(older)
    pins = json.loads((shop_bundle / "manifest.json").read_text())["cache"]["blocks"]
    v5 = Client(parse_repo(reg.repo("fleet/v5")))
    try:
        body, _ = v5.get_manifest(tag_of("shop", 1, shop_bundle.name))
    finally:
        v5.close()
    listed = [d["digest"] for d in json.loads(body)["layers"] if d["mediaType"] == BLOCK_TYPE]
    assert pins["block_tokens"] == 64 and listed == ["sha256:" + d for d in pins["sha256"]]
