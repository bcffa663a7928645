"""The one transport (httpx) and what makes a pull fast without dropping a check: the served
model's cache classes remembered by their exact inputs (no mlx-lm import); blobs redirected to a
store; TLS on loopback against a real docker-registry with a CA made here; a wrong scheme is one
line. Also the loopback fakes the hostile-registry tests share (Quiet, reply, serving)."""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.distribute.oci import Registry, parse_repo
from pipeline.format import served_identity
from pipeline.format.cache_state import model_cache_classes
from pipeline.format.errors import PipelineError
from pipeline.format.fingerprint import model_config
from pipeline.runtime.mount import identity_for as mount_identity

REPO = Path(__file__).resolve().parents[1]
PROXY_VARS = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")


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
            client = Registry(parse_repo(f"oci://{front}/fleet/bundles"), plain_http=True)
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
        client = Registry(parse_repo(f"oci://{front}/fleet/bundles"), plain_http=True)
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


# --- TLS on loopback: a real docker-registry with a certificate for 127.0.0.1 -----------------


@pytest.fixture
def no_credentials(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker-config"))
    monkeypatch.delenv("PREFIX_BUNDLES_REGISTRY_USER", raising=False)
    monkeypatch.delenv("PREFIX_BUNDLES_REGISTRY_PASSWORD", raising=False)


def test_a_tls_registry_on_loopback_round_trips_with_its_ca_bundle(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path, no_credentials, capsys
):
    """HTTPS is tried first on loopback (it was always plain HTTP there: this registry answered
    400 and push said only 'HTTP 400'), verified with --ca-bundle."""
    import shutil

    from registry_env import registry

    from pipeline.cli import main

    model = Path(shutil.copytree(tiny_model, tmp_path / "deploy" / "tiny"))
    with registry(tmp_path / "registry", tls=True) as reg:
        ca = ["--ca-bundle", str(reg.ca)]
        assert main(["push", str(shop_bundle), "--repo", reg.repo(), *ca]) == 0
        assert main(["pull", "--repo", reg.repo(), "--model", str(model), *ca]) == 0
        out = capsys.readouterr().out
        local = model / "prefix-bundles" / "shop" / "1" / shop_bundle.name
        assert f"-> {local}" in out
        assert (local / "cache.safetensors").read_bytes() == (
            shop_bundle / "cache.safetensors"
        ).read_bytes()


def test_a_wrong_scheme_or_an_untrusted_certificate_is_one_line(
    shop_bundle: Path, tmp_path: Path, no_credentials, capsys
):
    """A TLS port asked in plain HTTP, a plain port given a CA bundle, a certificate no CA given
    vouches for: each one line saying so (none retried as if the registry were down)."""
    from registry_env import registry

    from pipeline.cli import main

    push = ["push", str(shop_bundle), "--repo"]
    with registry(tmp_path / "tls", tls=True) as reg:
        host, ca = reg.host, str(reg.ca)
        blob = r"checking blob sha256:[0-9a-f]{12}"
        assert main([*push, reg.repo(), "--plain-http"]) == 1
        assert re.fullmatch(
            f"error: registry {host}: {blob}: its port speaks TLS \\(HTTPS\\), not plain HTTP; "
            "drop --plain-http\n",
            capsys.readouterr().err,
        )
        assert main([*push, reg.repo()]) == 1
        err = capsys.readouterr().err
        assert re.match(
            f"error: registry {host}: {blob}: its TLS certificate is not trusted by the system's "
            "CAs \\(",
            err,
        )
        assert err.endswith("pass --ca-bundle FILE with the CA that signed it\n")
        assert err.count("\n") == 1
        assert main([*push, reg.repo(), "--ca-bundle", str(tmp_path / "none.pem")]) == 1
        assert capsys.readouterr().err == (
            f"error: --ca-bundle {tmp_path / 'none.pem'}: cannot be read as PEM CA certificates "
            "(No such file or directory); pass the file holding the CA that signed the "
            "registry's certificate\n"
        )
        assert main([*push, reg.repo(), "--plain-http", "--ca-bundle", ca]) == 1
        assert "--plain-http and --ca-bundle contradict each other" in capsys.readouterr().err
    with registry(tmp_path / "plain") as reg:
        assert main([*push, reg.repo(), "--ca-bundle", ca]) == 1
        assert capsys.readouterr().err == (
            f"error: registry {reg.host}: it answers in plain HTTP, not TLS, but --ca-bundle "
            f"{ca} was given; serve the registry over TLS, or drop --ca-bundle\n"
        )


def test_pulling_from_a_repository_that_does_not_exist_is_one_line(
    tiny_model: Path, tmp_path: Path, no_credentials, capsys
):
    """Its tag list answers 404, whose body was read for the message: reading it again for the
    list was a traceback (httpx's StreamConsumed)."""
    from registry_env import registry

    from pipeline.cli import main

    with registry(tmp_path / "registry") as reg:
        assert main(["pull", "--repo", reg.repo("fleet/none"), "--model", str(tiny_model)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f"error: registry repo {reg.repo('fleet/none')}: no bundle for this model"
    )
    assert err.count("\n") == 1


@pytest.mark.parametrize("command", ["push", "pull"])
@pytest.mark.parametrize("option", [["--plain-http"], ["--ca-bundle", "ca.pem"]])
def test_registry_options_with_a_hub_repo_are_one_line_not_ignored(
    command: str, option: list[str], shop_bundle: Path, tiny_model: Path, capsys
):
    from pipeline.cli import main

    where = [str(shop_bundle)] if command == "push" else ["--model", str(tiny_model)]
    assert main([command, *where, "--repo", "org/bundles", *option]) == 1
    assert capsys.readouterr().err == (
        f"error: {option[0]} is for an oci:// registry; org/bundles is a hub repo (the hub "
        "client reads HF_ENDPOINT and the system's CAs): drop it\n"
    )


def test_a_tls_body_is_read_many_records_at_a_time_and_stays_exact(tmp_path: Path):
    """httpx reads a TLS body one record (at most 16 KiB) per event, each a Python round through
    h11, httpcore and httpx (most of a pull's CPU: docs/deploy.md); `oci_http.client` takes the
    records already arrived too. Fails where an httpx upgrade drops the backend silently."""
    import ssl

    from registry_env import make_tls

    from pipeline.distribute import oci_http

    ca, cert, key = make_tls(tmp_path)

    class Blob(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            reply(self, 200, BLOB * 8)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Blob)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with oci_http.client(str(ca)) as c:
            url = f"https://127.0.0.1:{server.server_address[1]}/blob"
            with c.stream("GET", url) as r:
                chunks = list(r.iter_raw())
    finally:
        server.shutdown()
        server.server_close()
    assert b"".join(chunks) == BLOB * 8
    assert max(len(chunk) for chunk in chunks) > 16 << 10  # more than one TLS record per read
