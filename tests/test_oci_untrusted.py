"""push / pull facing untrusted input: a registry's documents (artifact manifest, config, cache
header, tag list, Link and Location URLs), a token service's and a credential helper's answers, a
Docker config file, the files under <bundles>/.staging/resume, and a bundle rebuilt mid-push.

Each is one `error:` line naming what was wrong and where, exit 1, nothing published; never a
traceback, a hang, credentials sent to another origin or a write through a link.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from registry_env import Registry, corrupt, registry
from test_oci import no_docker_config  # noqa: F401 - an autouse fixture: no machine credentials
from test_oci_transport import Quiet, reply, serving

from pipeline.cli import main
from pipeline.distribute import oci_auth, oci_push
from pipeline.distribute.artifact import HEADER_TYPE, MAX_CONFIG_BYTES, parse_manifest, tag_of
from pipeline.distribute.blocks import MAX_HEADER_BYTES
from pipeline.distribute.oci import Registry as Client
from pipeline.distribute.oci import parse_repo
from pipeline.format.errors import PipelineError

NOTHING = "nothing was published"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def model(tmp_path: Path, tiny_model: Path) -> Path:
    return Path(shutil.copytree(tiny_model, tmp_path / "deploy" / "tiny"))


@pytest.fixture(scope="module")
def pushed(tmp_path_factory, shop_bundle: Path):
    """One registry holding the shop bundle, and its artifact manifest as pushed."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DOCKER_CONFIG", str(tmp_path_factory.mktemp("no-docker")))
        with registry(tmp_path_factory.mktemp("registry")) as reg:
            assert main(["push", str(shop_bundle), "--repo", reg.repo()]) == 0
            client = Client(parse_repo(reg.repo()))
            body, _ = client.get_manifest(tag_of("shop", 1, shop_bundle.name))
            client.close()
            yield reg, body


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def remake(reg: Registry, original: bytes, bundle: Path, edit) -> None:
    """The bundle's tag put on its artifact re-made by edit(client, manifest document), which
    returns the new manifest body (or None: the document, edited in place)."""
    client = Client(parse_repo(reg.repo()))
    try:
        doc = json.loads(original)
        body = edit(client, doc) or json.dumps(doc).encode()
        client.put_manifest(tag_of("shop", 1, bundle.name), body)
    finally:
        client.close()


def blob(kind: str, make):
    """An edit replacing the config or the cache header blob by make(its bytes)."""

    def edit(client: Client, doc: dict) -> None:
        d = doc["config"] if kind == "config" else _header(doc)
        data = make(client.get_blob(d["digest"], d["size"]))
        client.upload(sha(data), data)
        d["digest"], d["size"] = sha(data), len(data)

    return edit


def _header(doc: dict) -> dict:
    return next(d for d in doc["layers"] if d["mediaType"] == HEADER_TYPE)


def config_json(change):
    return blob("config", lambda data: json.dumps(change(json.loads(data))).encode())


def header_json(change):
    def make(data: bytes) -> bytes:
        (n,) = struct.unpack("<Q", data[:8])
        body = change(json.loads(data[8 : 8 + n]))
        body = body if isinstance(body, bytes) else json.dumps(body).encode()
        return struct.pack("<Q", len(body)) + body

    return blob("header", make)


def floats(h: dict) -> dict:
    for name, e in h.items():
        if name != "__metadata__":
            e["data_offsets"] = [float(x) for x in e["data_offsets"]]
    return h


DEEP = b"[" * 50_000 + b"]" * 50_000


def not_json(data: bytes) -> str:
    """How the parser words a document it refuses ('recursion limit exceeded at ...'), or ''."""
    from pydantic import TypeAdapter, ValidationError

    try:
        TypeAdapter(object).validate_json(data)
    except ValidationError as exc:
        return "not JSON (" + exc.errors()[0]["msg"].removeprefix("Invalid JSON: ") + ")"
    return ""


PADDED_CONFIG = MAX_CONFIG_BYTES + 1


def padded(size: int):
    return lambda data: b" " * (size - len(data)) + data


def nested_manifest(client: Client, doc: dict) -> bytes:
    return json.dumps(doc).encode()[:-1] + b',"x":' + b"[" * 3000 + b"]" * 3000 + b"}"


FIRST_TENSOR = "'0.0'"  # the header's first tensor by name
CASES = {
    "config without tokens": (
        config_json(lambda c: {k: v for k, v in c.items() if k != "tokens"}),
        "its config is not a bundle artifact's (tokens: Field required); push it again",
    ),
    "config tokens a boolean": (
        config_json(lambda c: {**c, "tokens": True}),
        "its config is not a bundle artifact's (tokens: Input should be a valid integer); push "
        "it again",
    ),
    "config nested 50,000 deep": (
        blob("config", lambda _: DEEP),
        "its config is not a bundle artifact's ({config_json}); push it again",
    ),
    "config of another schema": (
        config_json(lambda c: {**c, "schema": "mlx-prefix-bundles.artifact/2"}),
        "its config has schema 'mlx-prefix-bundles.artifact/2', not "
        "mlx-prefix-bundles.artifact/1; upgrade prefix-bundles",
    ),
    "config over the cap": (
        blob("config", padded(PADDED_CONFIG)),
        "its config blob {config} is {size:,} bytes, over the 1,048,576 a bundle's config may "
        "have (not read); push it again",
    ),
    "header nested 50,000 deep": (
        header_json(lambda h: json.dumps(h).encode()[:-1] + b',"zz":' + DEEP + b"}"),
        "the cache header does not parse ({header_json}); push it again",
    ),
    "header offsets as floats": (
        header_json(floats),
        f"the cache header's tensor {FIRST_TENSOR}: data_offsets.0: Input should be a valid "
        "integer; push it again",
    ),
    "header over the cap": (
        blob("header", padded(MAX_HEADER_BYTES + 1)),
        "its header blob {header} is {size:,} bytes, over the 16,777,216 a bundle's header may "
        "have (not read); push it again",
    ),
    "manifest nested 3,000 deep": (
        nested_manifest,
        "not a prefix-bundle artifact ({manifest_json}); push it with 'prefix-bundles push "
        "--repo oci://...'",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_malformed_artifact_document_is_one_line_and_nothing_is_published(
    case: str, pushed, shop_bundle: Path, model: Path, capsys
):
    reg, original = pushed
    edit, why = CASES[case]
    remake(reg, original, shop_bundle, edit)
    capsys.readouterr()
    assert main(["pull", "--repo", reg.repo(), "--model", str(model)]) == 1
    tag = tag_of("shop", 1, shop_bundle.name)
    client = Client(parse_repo(reg.repo()))
    body, _ = client.get_manifest(tag)
    doc = json.loads(body[: body.index(b',"x":')] + b"}" if b',"x":' in body else body)
    config, header = doc["config"], _header(doc)
    data = {k: client.get_blob(d["digest"], d["size"]) for k, d in [("c", config), ("h", header)]}
    client.close()
    size = config["size"] if case.startswith("config") else header["size"]
    where = f"bundle shop/1/{shop_bundle.name} from registry repo {reg.repo()} (tag {tag})"
    why = why.format(
        config=config["digest"][:19],
        header=header["digest"][:19],
        size=size,
        config_json=not_json(data["c"]),
        header_json=not_json(data["h"][8:]),
        manifest_json=not_json(body),
    )
    assert capsys.readouterr().err == f"error: {where}: {why}; {NOTHING}\n"
    assert not (model / "prefix-bundles" / "shop").exists()


# --- the tag list ------------------------------------------------------------------------------


def tag_server(mode: str, seen: list, other: str = ""):
    """A registry front whose tag list is `mode`; `other`: the origin a Link may name."""

    class Front(Quiet):
        def do_GET(self):
            seen.append((self.path, self.headers.get("authorization")))
            if not self.headers.get("authorization"):
                return reply(self, 401, b"{}", [("www-authenticate", 'Basic realm="r"')])
            bodies = {"html": b"<html>Login required</html>", "ints": b'{"tags": [1, 2]}'}
            body = bodies.get(mode, b'["a"]' if mode == "list" else b'{"tags": ["x"]}')
            link = {
                "loop": "</v2/fleet/bundles/tags/list?n=1000&last=x>",
                "other": f"<http://{other}/v2/fleet/bundles/tags/list?last=x>",
                "scheme": f"<https://{self.headers['host']}/v2/fleet/bundles/tags/list?last=x>",
            }.get(mode)
            reply(self, 200, body, [("link", f'{link}; rel="next"')] if link else [])

    return Front


@pytest.mark.parametrize(
    "mode, why",
    [
        ("html", "is not a tag list (not JSON (expected value at line 1 column 1)); check that "
         "{host} is an OCI registry (not a login page or a proxy)"),
        ("ints", "is not a tag list (tags.0: Input should be a valid string); check that {host} "
         "is an OCI registry (not a login page or a proxy)"),
        ("list", "is not a tag list (Input should be an object); check that {host} is an OCI "
         "registry (not a login page or a proxy)"),
        ("loop", ": its Link header goes on back to a page already read; check the registry"),
        ("other", ": its Link header sends the next page to another origin (http://{other}/v2/"
         "fleet/bundles/tags/list?last=x); no request was sent there"),
        ("scheme", ": its Link header sends the next page to another origin (https://{host}/v2/"
         "fleet/bundles/tags/list?last=x); no request was sent there"),
    ],
    ids=["html", "ints", "list", "loop", "other-host", "other-scheme"],
)  # fmt: skip
def test_a_bad_tag_list_is_one_line_and_no_credentials_leave_the_origin(
    mode: str, why: str, model: Path, capsys, monkeypatch
):
    seen: list = []
    monkeypatch.setenv("PREFIX_BUNDLES_REGISTRY_USER", "alice")
    monkeypatch.setenv("PREFIX_BUNDLES_REGISTRY_PASSWORD", "s3cret")
    with serving(tag_server("x", seen)) as other:
        with serving(tag_server(mode, seen, other)) as host:
            repo = f"oci://{host}/fleet/bundles"
            assert main(["pull", "--repo", repo, "--model", str(model)]) == 1
    sep = "" if why.startswith(":") else " "
    why = why.format(host=host, other=other)
    assert capsys.readouterr().err == (
        f"error: registry {host}: the tag list of fleet/bundles{sep}{why}: {NOTHING}\n"
    )
    assert all(path.startswith("/v2/fleet/bundles/tags/list?n=1000") for path, _ in seen)
    assert len(seen) <= 3  # the challenge, the answer, and for a loop the page linked once


def test_an_upload_location_on_another_origin_gets_no_credentials():
    """A registry that hands uploads to another host (a storage front): the PUT goes there
    without the registry's Authorization header, and that host's challenge is not answered."""
    seen: list = []

    class Store(Quiet):
        def do_PUT(self):
            seen.append(("store", self.headers.get("authorization")))
            self.rfile.read(int(self.headers["content-length"]))
            status = 401 if "challenge" in self.path else 201
            self.send_response(status)
            self.send_header("www-authenticate", 'Basic realm="store"')
            self.send_header("content-length", "0")
            self.end_headers()

    with serving(Store) as store:

        class Front(Quiet):
            def do_POST(self):
                seen.append(("registry", self.headers.get("authorization")))
                self.send_response(202)
                where = "challenge" if "challenge" in self.headers.get("x-test", "") else "ok"
                self.send_header("location", f"http://{store}/upload/{where}?state=1")
                self.send_header("content-length", "0")
                self.end_headers()

        with serving(Front) as front:
            client = Client(parse_repo(f"oci://{front}/fleet/bundles"))
            client.creds = oci_auth.Creds("alice", "s3cret", "test")
            client.header = {"authorization": oci_auth.basic(client.creds)}
            try:
                client.upload(sha(b"data"), b"data")
                client.header = {**client.header, "x-test": "challenge"}
                with pytest.raises(PipelineError, match="HTTP 401"):
                    client.upload(sha(b"data"), b"data")
            finally:
                client.close()
    basic = oci_auth.basic(oci_auth.Creds("alice", "s3cret", "test"))
    assert seen == [("registry", basic), ("store", None), ("registry", basic), ("store", None)]


# --- credentials ---------------------------------------------------------------------------------


def test_a_token_service_answering_html_is_one_line(model: Path, capsys):
    class Front(Quiet):
        def do_GET(self):
            if self.path.startswith("/token"):
                body, status = b"<html>SSO login</html>", 200
            else:
                body, status = b"{}", 401
            self.send_response(status)
            realm = f"http://{self.headers['host']}/token"
            self.send_header("www-authenticate", f'Bearer realm="{realm}",service="reg"')
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    with serving(Front) as host:
        assert main(["pull", "--repo", f"oci://{host}/fleet/bundles", "--model", str(model)]) == 1
    assert capsys.readouterr().err == (
        f"error: registry {host}: listing tags: the token service http://{host}/token answered "
        "with no token (not JSON (expected value at line 1 column 1)); check that it is the "
        "registry's token service, then retry\n"
    )


def write_config(tmp_path: Path, monkeypatch, config) -> Path:
    folder = tmp_path / "docker"
    folder.mkdir(exist_ok=True)
    path = folder / "config.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    monkeypatch.setenv("DOCKER_CONFIG", str(folder))
    return path


@pytest.mark.parametrize(
    "config, why",
    [
        ({"auths": {"reg.example": {"auth": "not-base64!"}}},
         "{path}: auths['reg.example']: its `auth` is not base64 of user:password; log in "
         "again with 'docker login', or set PREFIX_BUNDLES_REGISTRY_USER and "
         "PREFIX_BUNDLES_REGISTRY_PASSWORD"),
        (["not", "an", "object"],
         "{path}: cannot be read as a Docker config file (Input should be an object); fix or "
         "remove it, or set PREFIX_BUNDLES_REGISTRY_USER and PREFIX_BUNDLES_REGISTRY_PASSWORD"),
        ({"auths": {"reg.example": {"auth": 7}}},
         "{path}: cannot be read as a Docker config file (auths.reg.example.auth: Input should "
         "be a valid string); fix or remove it, or set PREFIX_BUNDLES_REGISTRY_USER and "
         "PREFIX_BUNDLES_REGISTRY_PASSWORD"),
        ('{"auths": ' + "[" * 5000 + "]" * 5000 + "}",
         "{path}: cannot be read as a Docker config file (not JSON (recursion limit exceeded "
         "at line 1 column 211)); fix or remove it, or set PREFIX_BUNDLES_REGISTRY_USER and "
         "PREFIX_BUNDLES_REGISTRY_PASSWORD"),
    ],
    ids=["auth-not-base64", "a-list", "auth-not-a-string", "nested-5000-deep"],
)  # fmt: skip
def test_a_broken_docker_config_is_one_line_naming_it(config, why, tmp_path, monkeypatch):
    path = write_config(tmp_path, monkeypatch, config)
    with pytest.raises(PipelineError) as exc:
        oci_auth.credentials("reg.example")
    assert str(exc.value) == why.format(path=path)


def test_a_credential_helper_printing_no_json_is_one_line(tmp_path: Path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    helper = bin_dir / "docker-credential-odd"
    helper.write_text("#!/bin/sh\necho 'Please log in at https://sso.example'\n")
    helper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    write_config(tmp_path, monkeypatch, {"credsStore": "odd"})
    with pytest.raises(PipelineError) as exc:
        oci_auth.credentials("reg.example")
    assert str(exc.value) == (
        "the credential helper docker-credential-odd answered for reg.example with no "
        "credentials JSON (not JSON (expected value at line 1 column 1)); fix the helper, or set "
        "PREFIX_BUNDLES_REGISTRY_USER and PREFIX_BUNDLES_REGISTRY_PASSWORD"
    )


# --- the resume folder ---------------------------------------------------------------------------


def _victim(tmp_path: Path, size: int) -> Path:
    victim = tmp_path / "outside" / "victim.db"
    victim.parent.mkdir(exist_ok=True)
    victim.write_bytes(b"PRECIOUS" * (size // 8) + b"P" * (size % 8))
    return victim


def _part_link(resume: Path, part: Path, victim: Path) -> None:
    resume.mkdir(parents=True)
    part.symlink_to(victim)


def _part_hard_link(resume: Path, part: Path, victim: Path) -> None:
    resume.mkdir(parents=True)
    os.link(victim, part)


def _folder_link(resume: Path, part: Path, victim: Path) -> None:
    resume.parent.mkdir(parents=True)
    resume.symlink_to(victim.parent)
    shutil.copy(victim, victim.parent / part.name)  # a partial file there, looking fit


@pytest.mark.parametrize("plant", [_part_link, _part_hard_link, _folder_link])
def test_a_resume_file_or_folder_that_is_a_link_is_never_written_through(
    plant, tmp_path: Path, shop_bundle: Path, model: Path, capsys
):
    """A .part that is a symlink or a second name of another file, or a `resume` folder that is
    a symlink: an interrupted pull (a tampered block) keeps nothing through it, the next pull
    downloads every block, and the file outside is unchanged."""
    with registry(tmp_path / "registry") as reg:
        assert main(["push", str(shop_bundle), "--repo", reg.repo()]) == 0
        client = Client(parse_repo(reg.repo()))
        body, digest = client.get_manifest(tag_of("shop", 1, shop_bundle.name))
        client.close()
        cache = shop_bundle / "cache.safetensors"
        victim = _victim(tmp_path, cache.stat().st_size)
        before = victim.read_bytes()
        resume = model / "prefix-bundles" / ".staging" / "resume"
        plant(resume, resume / f"{digest.split(':')[1]}.part", victim)
        outside = sorted(p.name for p in victim.parent.iterdir())

        last = reg.blob_file(parse_manifest(body, "test").blocks[-1].digest)
        saved = last.read_bytes()
        corrupt(last)
        assert main(["pull", "--repo", reg.repo(), "--model", str(model)]) == 1
        last.write_bytes(saved)
        assert main(["pull", "--repo", reg.repo(), "--model", str(model)]) == 0
    capsys.readouterr()
    assert victim.read_bytes() == before
    assert sorted(p.name for p in victim.parent.iterdir()) == outside
    published = model / "prefix-bundles" / "shop" / "1" / shop_bundle.name / "cache.safetensors"
    assert not published.is_symlink() and published.stat().st_nlink == 1
    assert published.read_bytes() == cache.read_bytes()


# --- a bundle rebuilt while it is pushed ---------------------------------------------------------


def _rebuild_by_rename(work: Path) -> None:
    """What a rebuild's publish does: another folder renamed into place."""
    new = Path(shutil.copytree(work, work.with_name("rebuild.tmp")))
    os.rename(work, work.with_name("old.tmp"))
    os.rename(new, work)


def _edit_in_place(work: Path) -> None:
    cache = work / "cache.safetensors"
    with open(cache, "r+b") as f:
        f.seek(cache.stat().st_size - 1)
        last = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([last[0] ^ 1]))


def _cut_short_in_place(work: Path) -> None:
    """What `cp` over the file does first (a careless deploy script copying while it is pushed)."""
    os.truncate(work / "cache.safetensors", 4096)


@pytest.mark.parametrize(
    "when, change",
    [("validated", _rebuild_by_rename), ("uploading", _rebuild_by_rename),
     ("uploading", _edit_in_place), ("uploading", _cut_short_in_place)],
)  # fmt: skip
def test_a_bundle_changed_while_it_is_pushed_is_refused_and_its_tag_stays(
    when: str, change, tmp_path: Path, shop_bundle: Path, capsys, monkeypatch
):
    """After validation (before the push opens its files) or while its blocks go up: one line,
    and the tag keeps the good artifact the first push gave it."""
    work = tmp_path / "bundles" / "shop" / "1" / shop_bundle.name
    shutil.copytree(shop_bundle, work)
    tag = tag_of("shop", 1, shop_bundle.name)
    with registry(tmp_path / "registry") as reg:
        assert main(["push", str(work), "--repo", reg.repo()]) == 0
        client = Client(parse_repo(reg.repo()))
        good = client.get_manifest(tag)[1]
        owner, attr = (Client, "has_blob") if when == "uploading" else (oci_push, "Registry")
        real, done = getattr(owner, attr), []

        def hooked(*args, **kw):  # the change happens once, then the real call
            if not done:
                done.append(change(work))
            return real(*args, **kw)

        monkeypatch.setattr(owner, attr, hooked)
        capsys.readouterr()
        assert main(["push", str(work), "--repo", reg.repo()]) == 1
        assert client.get_manifest(tag)[1] == good
        client.close()
    name = "SHA256SUMS" if change is _rebuild_by_rename else "cache.safetensors"
    assert capsys.readouterr().err == (
        f"error: bundle shop/1/{shop_bundle.name} ({work}): the bundle changed while it was "
        f"pushed ({name} is not the file validated); push again. Its tag was not moved\n"
    )


PUSH_READ = (  # a push under way (block 0 went up), then the last block hashed and sent
    "with source.views(0) as parts:\n    pass\n"
    "os.truncate(path, 4096)\n"
    "with source.views(plan.blocks - 1) as parts:\n"
    "    print(sum(map(len, parts)) > 0 and set(b''.join(parts)) == {0})\n"
)
REUSE_READ = (  # a pull taking the last block from a local bundle: short, so downloaded instead
    "os.truncate(path, 4096)\n"
    "k = plan.blocks - 1\n"
    "print(len(source.block(k)) < sum(n for _, n in plan.block_ranges(k)))\n"
)


@pytest.mark.parametrize("read", [PUSH_READ, REUSE_READ], ids=["push", "pull-reuse"])
def test_a_cache_file_cut_short_while_its_blocks_are_read_is_not_sigbus(
    read: str, shop_bundle: Path, tmp_path: Path
):
    """Blocks are read by pread, never through a mapping: a file truncated meanwhile (cp over
    it) reads short or zeros past its end, and the process lives on (a fresh process: a mapping
    would die of SIGBUS, -7). A push's check of its pinned files then refuses the change."""
    cache = Path(shutil.copy(shop_bundle / "cache.safetensors", tmp_path / "c.safetensors"))
    tokens = json.loads((shop_bundle / "manifest.json").read_text())["tokens"]["count"]
    code = (
        "import os\n"
        "from pipeline.distribute.blocks import Source, read_layout\n"
        f"path = {str(cache)!r}\n"
        f"plan = read_layout(path, {tokens})\n"
        "source = Source(path, plan)\n"
    ) + read
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert (out.returncode, out.stdout) == (0, "True\n"), out.stderr
