"""What makes a pull fast without dropping a check: the served model's cache classes remembered by
their exact inputs (no mlx-lm import), and blob bodies read in place over plain HTTP."""

from __future__ import annotations

import hashlib
import http.server
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.distribute.oci import Registry, parse_repo
from pipeline.distribute.oci_plain import PROXY_VARS
from pipeline.format import served_identity
from pipeline.format.cache_state import model_cache_classes
from pipeline.format.errors import PipelineError
from pipeline.format.fingerprint import model_config
from pipeline.runtime.mount import identity_for as mount_identity

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def private_memo(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "memo"))
    for var in PROXY_VARS:
        monkeypatch.delenv(var, raising=False)


class Quiet(http.server.BaseHTTPRequestHandler):
    """A loopback handler speaking HTTP/1.1 (keep-alive), logging nothing."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass


def test_the_remembered_identity_is_the_one_mount_computes(tiny_model: Path):
    first = served_identity.identity_for(tiny_model)  # asked of mlx-lm, then remembered
    assert served_identity.table_path().exists()
    again = served_identity.identity_for(tiny_model)
    asked = model_cache_classes(model_config(tiny_model))  # mlx-lm's own answer, no memo
    assert first == again and again.shape.cache_classes == asked is not None
    assert mount_identity is served_identity.identity_for  # the runtime's is this one


def test_a_remembered_identity_does_not_import_mlx_lm(tiny_model: Path, tmp_path: Path):
    served_identity.identity_for(tiny_model)
    code = (
        "import sys; from pathlib import Path\n"
        "from pipeline.format.served_identity import identity_for\n"
        f"identity_for(Path({str(tiny_model)!r}))\n"
        "print(sorted(m for m in ('mlx_lm', 'transformers') if m in sys.modules))\n"
    )
    env = {"PREFIX_BUNDLES_CACHE_DIR": str(tmp_path / "memo"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout == "[]\n"


def test_the_key_changes_with_every_input(tiny_model: Path, tmp_path: Path, monkeypatch):
    """The config, and any source file of mlx-lm (here a stand-in tree): a new key each."""
    tree = tmp_path / "mlx_lm"
    (tree / "models").mkdir(parents=True)
    (tree / "models" / "cache.py").write_text("a = 1\n")
    spec = SimpleNamespace(submodule_search_locations=[str(tree)])
    monkeypatch.setattr(served_identity.importlib.util, "find_spec", lambda name: spec)
    config = model_config(tiny_model)
    key = served_identity.inputs_key(config)
    assert key is not None and key == served_identity.inputs_key(config)
    assert served_identity.inputs_key({**config, "num_hidden_layers": 3}) != key
    (tree / "models" / "cache.py").write_text("a = 2\n")  # same size: mtime and ctime differ
    changed = served_identity.inputs_key(config)
    assert changed != key
    (tree / "models" / "new_arch.py").write_text("")
    assert served_identity.inputs_key(config) not in (key, changed)


def test_a_remembered_value_that_is_not_a_class_list_is_asked_again(tiny_model: Path, monkeypatch):
    config = model_config(tiny_model)
    key = served_identity.inputs_key(config)
    path = served_identity.table_path()
    path.parent.mkdir(mode=0o700, parents=True)
    path.write_text(json.dumps({key: '{"a": 1}'}))
    path.chmod(0o600)
    asked = []
    real = served_identity.cache_state.model_cache_classes
    monkeypatch.setattr(
        served_identity.cache_state,
        "model_cache_classes",
        lambda c: (asked.append(1), real(c))[1],
    )
    assert served_identity.cache_classes(config) == real(config)
    assert asked == [1]
    assert served_identity.cache_classes(config) == real(config)
    assert asked == [1]  # remembered now


BLOB = bytes(range(256)) * 4096  # 1 MiB
DIGEST = "sha256:" + hashlib.sha256(BLOB).hexdigest()


def reply(handler, status: int, body: bytes = b"", headers=()) -> None:
    """A whole answer from a loopback handler: status, headers, its length and body."""
    handler.send_response(status)
    for k, v in headers:
        handler.send_header(k, v)
    handler.send_header("content-length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@contextmanager
def serving(handler: type, host: str = "127.0.0.1") -> Iterator[str]:
    server = http.server.ThreadingHTTPServer((host, 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_blob_follows_a_redirect_without_the_credentials_and_keeps_its_connection():
    """The registry redirects blob GETs to a store on another host (as S3-backed ones do): the
    bytes come from there, checked; the Authorization header stays with the registry; a second
    blob reuses the open connections."""
    seen: list[tuple[str, str | None, int]] = []

    class Store(Quiet):
        def do_GET(self):
            seen.append(("store", self.headers.get("authorization"), self.client_address[1]))
            data = BLOB if self.path.endswith("good") else BLOB[:-1] + b"x"
            self.send_response(200)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    with serving(Store) as store:

        class Front(Quiet):
            def do_GET(self):
                seen.append(("registry", self.headers.get("authorization"), self.client_address[1]))
                self.send_response(307)
                tail = "good" if "good" in self.headers.get("x-test", "good") else "bad"
                self.send_header("location", f"http://{store}/data/{tail}")
                self.send_header("content-length", "0")
                self.end_headers()

        with serving(Front) as front:
            client = Registry(parse_repo(f"oci://{front}/fleet/bundles"))
            assert client.plain is not None
            client.header = {"authorization": "Bearer secret"}
            try:
                assert client.get_blob(DIGEST, len(BLOB)) == BLOB
                assert client.get_blob(DIGEST, len(BLOB)) == BLOB
                client.header = {**client.header, "x-test": "bad"}
                with pytest.raises(PipelineError, match="is not what its manifest lists"):
                    client.get_blob(DIGEST, len(BLOB))
            finally:
                client.close()
    assert [(who, auth) for who, auth, _ in seen] == [
        ("registry", "Bearer secret"),
        ("store", None),
    ] * 3
    registry_conns = {c for who, _, c in seen if who == "registry"}
    store_conns = {c for who, _, c in seen if who == "store"}
    assert len(registry_conns) == 1 and len(store_conns) == 1  # kept alive


def test_with_a_proxy_set_blobs_go_through_httpx(monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    client = Registry(parse_repo("oci://127.0.0.1:5000/fleet/bundles"))
    try:
        assert client.plain is None
    finally:
        client.close()


def test_a_request_without_a_body_still_says_its_length():
    """An upload session is opened with an empty POST: Content-Length 0, as httpx sends it
    (registries behind a proxy answer 411 without it)."""
    seen: list[str | None] = []

    class Front(Quiet):
        def do_POST(self):
            seen.append(self.headers.get("content-length"))
            self.send_response(202)
            self.send_header("location", "/v2/fleet/bundles/blobs/uploads/1")
            self.send_header("content-length", "0")
            self.end_headers()

    with serving(Front) as front:
        client = Registry(parse_repo(f"oci://{front}/fleet/bundles"))
        try:
            r = client.request("POST", f"{client.base}/blobs/uploads/", "opening", (202,))
        finally:
            client.close()
    assert seen == ["0"] and r.headers["location"].endswith("/uploads/1")


def test_block_digests_computed_ahead_are_the_blocks_and_a_changed_file_gets_none(
    shop_bundle: Path, tmp_path: Path
):
    """Prehash hashes while the validator reads: its digests are the blocks' own, and once the
    file changes (another stat) none is handed out: the push hashes what it sends itself."""
    import shutil

    from pipeline.distribute.blocks import Source, read_layout
    from pipeline.distribute.prehash import Prehash

    bundle = Path(shutil.copytree(shop_bundle, tmp_path / "shop"))
    cache = bundle / "cache.safetensors"
    tokens = json.loads((bundle / "manifest.json").read_text())["tokens"]["count"]
    plan = read_layout(cache, tokens)
    source = Source(cache, plan)
    want = ["sha256:" + hashlib.sha256(source.block(k)).hexdigest() for k in range(plan.blocks)]
    source.close()
    ahead = Prehash([bundle, tmp_path / "missing"])  # an unreadable bundle is left out
    try:
        assert plan.blocks > 1
        assert [ahead.digest(cache, plan, k) for k in range(plan.blocks)] == want
        other = read_layout(cache, tokens, block_size=plan.block_tokens // 2)
        assert ahead.digest(cache, other, 0) is None  # cut another way: not this digest
        with open(cache, "r+b") as f:  # same size, other bytes: its stat changes
            f.seek(plan.file_bytes - 1)
            f.write(b"\0" if f.read(1) != b"\0" else b"\1")
        assert ahead.digest(cache, plan, 0) is None
    finally:
        ahead.close()


def test_plain_http_needs_no_httpx(tmp_path: Path):
    """A plain-HTTP registry is served without importing httpx (its import cost a pull's start
    ~30-45 ms): a blob GET, a Location resolved against its request and a repeated challenge
    header, in a fresh process."""

    class Front(Quiet):
        def do_GET(self):
            self.send_response(200)
            self.send_header("content-length", str(len(BLOB)))
            self.send_header("WWW-Authenticate", 'Basic realm="a"')
            self.send_header("www-authenticate", 'Bearer realm="b"')
            self.send_header("Location", "../uploads/1?_state=x")
            self.end_headers()
            self.wfile.write(BLOB)

    with serving(Front) as front:
        code = (
            "import sys\n"
            "from pipeline.distribute.oci import Registry, parse_repo\n"
            f"c = Registry(parse_repo('oci://{front}/fleet/bundles'))\n"
            f"assert c.get_blob({DIGEST!r}, {len(BLOB)}) == bytes(range(256)) * 4096\n"
            "r = c.request('GET', c.base + '/blobs/x/y', 'asking', (200,))\n"
            "print(c._location(r))\n"
            "print(r.headers.get('Www-Authenticate'))\n"
            "print('LOCATION' in r.headers, r.headers['Content-Length'])\n"
            "print(sorted(m for m in ('httpx', 'httpx2') if m in sys.modules))\n"
        )
        env = {"PREFIX_BUNDLES_CACHE_DIR": str(tmp_path / "memo"), "PATH": "/usr/bin:/bin"}
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
        )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"http://{front}/v2/fleet/bundles/blobs/uploads/1?_state=x",
        'Basic realm="a", Bearer realm="b"',
        f"True {len(BLOB)}",
        "[]",
    ]
