"""A hostile or broken registry, token service or network, at the HTTP level (found by an outside
review): credentials never reach a token service in clear on another machine nor a store a blob
is redirected to; no body is read without a bound (an error's, a redirect's, the tag list across
pages); a challenge is answered once; a body cut short by a clean close is resumed, not called
damaged; what the registry names that cannot be sent is one line, never a traceback."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from registry_env import registry
from test_oci import no_docker_config  # noqa: F401 - an autouse fixture: no machine credentials
from test_oci_transport import BLOB, DIGEST, PROXY_VARS, Quiet, reply, serving

from pipeline.cli import main
from pipeline.distribute import oci_auth, oci_tags
from pipeline.distribute.oci import Registry, parse_repo
from pipeline.distribute.untrusted import may_carry_credentials
from pipeline.format.errors import PipelineError

SECRET = oci_auth.basic(oci_auth.Creds("alice", "s3cret", "test"))


@pytest.fixture(autouse=True)
def alice(no_docker_config, monkeypatch):  # noqa: F811 - after it: these credentials stay
    monkeypatch.setenv("PREFIX_BUNDLES_REGISTRY_USER", "alice")
    monkeypatch.setenv("PREFIX_BUNDLES_REGISTRY_PASSWORD", "s3cret")
    for var in PROXY_VARS:
        monkeypatch.delenv(var, raising=False)


def client(host: str) -> Registry:
    return Registry(parse_repo(f"oci://{host}/fleet/bundles"), plain_http=True)


def token_service(seen: list):
    class Tokens(Quiet):
        count = itertools.count()

        def do_GET(self):
            seen.append(self.headers.get("authorization"))
            reply(self, 200, json.dumps({"token": f"t{next(self.count)}"}).encode())

    return Tokens


@pytest.mark.parametrize(
    ("realm", "base", "may"),
    [
        ("https://auth.example/token", "https://registry.example/v2/x", True),  # Docker Hub's way
        ("http://registry.example/token", "http://registry.example/v2/x", True),  # its own origin
        ("http://127.0.0.1:9/token", "http://127.0.0.1:5000/v2/x", True),  # a local rehearsal
        ("http://auth.example/token", "https://registry.example/v2/x", False),  # in clear
        ("http://registry.example/token", "https://registry.example/v2/x", False),  # downgraded
        ("http://127.0.0.1:9/token", "https://127.0.0.2:5000/v2/x", False),
        ("http://127.0.0.1:9/token", "http://10.0.0.5:5000/v2/x", False),
    ],
)  # fmt: skip
def test_which_token_service_may_get_the_registry_credentials(realm: str, base: str, may: bool):
    assert may_carry_credentials(realm, base) is may


def test_a_token_service_in_clear_on_another_machine_gets_no_credentials(tiny_model, capsys):
    """A registry reached over plain HTTP at 127.0.0.2 (another machine, as far as the rule can
    tell) names a plain-HTTP token service elsewhere: the password went there in clear."""
    seen: list = []
    with serving(token_service(seen)) as tokens:

        class Front(Quiet):
            def do_GET(self):
                realm = f'Bearer realm="http://{tokens}/token",service="reg"'
                reply(self, 401, b"{}", [("www-authenticate", realm)])

        with serving(Front, host="127.0.0.2") as host:
            argv = ["pull", "--repo", f"oci://{host}/fleet/bundles", "--model", str(tiny_model)]
            assert main([*argv, "--plain-http"]) == 1
    assert capsys.readouterr().err == (
        f"error: registry {host}: listing tags: the token service http://{tokens}/token is plain "
        f"HTTP on another origin: the credentials for {host} are not sent there in clear; have "
        "the registry name an https:// token service\n"
    )
    assert seen == []


def challenging(tokens: str):
    """A front answering every GET 401 with a Bearer challenge naming the token service."""

    class Front(Quiet):
        def do_GET(self):
            realm = f'Bearer realm="http://{tokens}/token"'
            reply(self, 401, b"{}", [("www-authenticate", realm)])

    return Front


def test_a_store_a_blob_is_redirected_to_gets_no_answer_to_its_challenge():
    """A 401 from the store the registry redirected a blob to: not answered (the registry's
    credentials went to the store's token service), and the blob fails as not authorized."""
    seen: list = []
    with serving(token_service(seen)) as tokens:
        with serving(challenging(tokens)) as store:

            class Front(Quiet):
                def do_GET(self):
                    reply(self, 307, b"", [("location", f"http://{store}/data")])

            with serving(Front) as front:
                registry = client(front)
                registry.creds = oci_auth.Creds("alice", "s3cret", "test")
                try:
                    with pytest.raises(PipelineError, match=r"not authorized \(HTTP 401"):
                        registry.get_blob(DIGEST, len(BLOB))
                finally:
                    registry.close()
    assert seen == []


def test_a_blob_challenge_is_answered_once_not_in_a_loop():
    """A token service handing a new token each time and a blob that always answers 401: ~970
    token requests and a RecursionError line before; now one answer, then not authorized."""
    seen: list = []
    with serving(token_service(seen)) as tokens:
        with serving(challenging(tokens)) as front:
            registry = client(front)
            try:
                with pytest.raises(PipelineError, match=r"not authorized \(HTTP 401, as 'alice'"):
                    registry.get_blob(DIGEST, len(BLOB))
            finally:
                registry.close()
    assert seen == [SECRET]


def endless(handler, status: int, sent: list) -> None:
    """An answer whose chunked body goes on (up to 256 MiB) until the client hangs up."""
    handler.send_response(status)
    handler.send_header("transfer-encoding", "chunked")
    handler.end_headers()
    piece, n = b"x" * (1 << 20), [0]
    sent.append(n)  # what this answer got out, as it goes
    try:
        for _ in range(256):
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            n[0] += len(piece)
        handler.wfile.write(b"0\r\n\r\n")
    except OSError:
        pass


@pytest.mark.parametrize("status", [404, 500, 307])
def test_an_error_or_redirect_body_is_read_no_further_than_its_message_needs(status: int):
    """The body of an error (or a redirect) was read whole: an endless one filled memory (httpx
    reads a redirect's body whole when it follows it: redirects are followed here)."""
    sent: list = []

    class Front(Quiet):
        def do_GET(self):
            if status == 307:
                self.send_response(307)
                self.send_header("location", "/elsewhere")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                return endless_body(self, sent)
            endless(self, status, sent)

    def endless_body(handler, sent):
        piece, n = b"x" * (1 << 20), [0]
        sent.append(n)
        try:
            for _ in range(256):
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                n[0] += len(piece)
        except OSError:
            pass

    with serving(Front) as front:
        registry = client(front)
        registry.sleep = lambda s: None
        try:
            with pytest.raises(PipelineError):
                registry.get_manifest("shop.V1.tiny-0123456789ab")
            with pytest.raises(PipelineError):
                registry.get_blob(DIGEST, len(BLOB))
        finally:
            registry.close()
    assert sent and max(n for (n,) in sent) < 32 << 20  # per answer: socket buffers, not 256 MiB


def test_the_tag_list_is_bounded_across_pages_and_a_tag_counts_once(monkeypatch):
    """Pages of up to 4 MiB each, up to 1,000 of them: ~32 GB of memory before; now at most
    MAX_LIST_BYTES across pages, and a tag listed on two pages (added while paging) is one."""
    monkeypatch.setattr(oci_tags, "MAX_LIST_BYTES", 1 << 20)
    pages = {0: ["shop.V1.tiny-0123456789ab", "a"], 1: ["a", "b"]}

    class Front(Quiet):
        def do_GET(self):
            page = int(self.path.rpartition("last=")[2] or 0) if "last=" in self.path else 0
            tags = pages.get(page, [f"t{page}-{i:06d}" for i in range(20_000)])
            link = [("link", f'</v2/fleet/bundles/tags/list?n=1000&last={page + 1}>; rel="next"')]
            reply(self, 200, json.dumps({"tags": tags}).encode(), link if page < 50 else [])

    with serving(Front) as front:
        registry = client(front)
        try:
            with pytest.raises(PipelineError, match=r"is over 1,048,576 bytes across its first"):
                registry.tags()
            pages.update({2: ["b"]})
            monkeypatch.setattr(oci_tags, "MAX_LIST_BYTES", 16 << 20)
            pages.update({n: [] for n in range(3, 51)})
            assert registry.tags() == ["a", "b", "shop.V1.tiny-0123456789ab"]
        finally:
            registry.close()


def test_a_blob_cut_short_by_a_clean_close_is_resumed_not_called_damaged():
    """The store sends its Content-Length, half the body, then closes: http.client hands back
    what came, and the blob was refused as 'damaged or altered' with no retry."""
    ranges: list = []

    class Store(Quiet):
        def do_GET(self):
            ranges.append(self.headers.get("range"))
            if self.headers.get("range"):
                start = int(self.headers["range"].split("=")[1].rstrip("-"))
                self.send_response(206)
                self.send_header("content-range", f"bytes {start}-{len(BLOB) - 1}/{len(BLOB)}")
                self.send_header("content-length", str(len(BLOB) - start))
                self.end_headers()
                self.wfile.write(BLOB[start:])
                return
            self.send_response(200)
            self.send_header("content-length", str(len(BLOB)))
            self.send_header("connection", "close")
            self.end_headers()
            self.wfile.write(BLOB[: len(BLOB) // 2])
            self.close_connection = True

    with serving(Store) as store:
        registry = client(store)
        registry.sleep = lambda s: None
        try:
            assert registry.get_blob(DIGEST, len(BLOB)) == BLOB
        finally:
            registry.close()
    assert ranges == [None, f"bytes={len(BLOB) // 2}-"]


def test_what_a_registry_names_that_cannot_be_used_is_one_line():
    """A HEAD's Content-Length that is not a number, an upload opened with no Location, a token
    with a line break (an invalid header value), a redirect loop through httpx: each was a
    traceback (ValueError, KeyError, ValueError, TooManyRedirects)."""
    mode = {"now": ""}
    seen: list = []

    class Front(Quiet):
        def do_HEAD(self):
            self.send_response(200)
            self.send_header("content-length", "abc")
            self.end_headers()

        def do_POST(self):
            reply(self, 202)

        def do_GET(self):
            if self.path.startswith("/token"):
                seen.append(self.path)
                return reply(self, 200, json.dumps({"token": "a\nb"}).encode())
            if mode["now"] == "token":
                realm = f'Bearer realm="http://{self.headers["host"]}/token"'
                return reply(self, 401, b"{}", [("www-authenticate", realm)])
            reply(self, 302, b"", [("location", self.path)])

    with serving(Front) as front:
        registry = client(front)
        registry.sleep = lambda s: None
        try:
            with pytest.raises(PipelineError, match="Content-Length .*not a size"):
                registry.has_blob(DIGEST)
            with pytest.raises(
                PipelineError, match=r"opened an upload \(HTTP 202\) with no Location"
            ):
                registry.upload(DIGEST, BLOB)
            mode["now"] = "token"
            with pytest.raises(PipelineError, match="a token that cannot be sent in a header"):
                registry.get_blob(DIGEST, len(BLOB))
            mode["now"] = ""
            with pytest.raises(PipelineError, match="failed after 4 tries"):
                registry.get_blob(DIGEST, len(BLOB))
        finally:
            registry.close()
    assert seen


def test_a_credential_helper_that_does_not_answer_is_named_as_such(tmp_path, monkeypatch):
    helper = tmp_path / "bin" / "docker-credential-slow"
    helper.parent.mkdir()
    helper.write_text("#!/bin/sh\nsleep 30\n")
    helper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{helper.parent}:/usr/bin:/bin")
    monkeypatch.setattr(oci_auth, "HELPER_TIMEOUT_S", 0.5)
    (tmp_path / "docker").mkdir()
    (tmp_path / "docker" / "config.json").write_text('{"credsStore": "slow"}')
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    monkeypatch.delenv("PREFIX_BUNDLES_REGISTRY_USER", raising=False)
    with pytest.raises(
        PipelineError, match=r"docker-credential-slow .* did not answer within 0.5 s"
    ):
        oci_auth.credentials("registry.example")


def test_a_lockfile_pin_for_a_folder_that_is_not_a_model_folder_is_refused(tmp_path):
    """A lockfile's model folder key with a '/' gave a traceback in pull (a tuple unpacking)."""
    from pipeline.format.lockfile import LockError, read_lock

    entry = {"version": 1, "content_sha256": "0" * 64, "template_sha256": "0" * 64}
    entry["models"] = {"sub/tiny-0123456789ab": "1" * 64}
    path = tmp_path / "prefixes.lock"
    path.write_text(json.dumps({"lock_version": 1, "prefixes": {"shop": entry}}))
    with pytest.raises(LockError, match=r"prefixes\.shop\.models\.sub/tiny-0123456789ab"):
        read_lock(path)


FULL_DISK = """
import resource, signal, sys
from pipeline.cli import main
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
sys.exit(main(sys.argv[1:]))
"""


def test_a_full_disk_during_an_oci_pull_names_the_folder(shop_bundle, tiny_model, tmp_path):
    """A write that fails under the bundles folder was 'error: I/O: No space left on device'
    (no path, no bundle): now the folder, what to do, and where the blocks that came are kept."""
    root = Path(__file__).resolve().parents[1]
    bundles = tmp_path / "bundles"
    with registry(tmp_path / "registry") as reg:
        assert main(["push", str(shop_bundle), "--repo", reg.repo()]) == 0
        argv = ["pull", "--repo", reg.repo(), "--model", str(tiny_model), "--bundles", str(bundles)]
        out = subprocess.run(
            [sys.executable, "-c", FULL_DISK, *argv], cwd=root, capture_output=True, text=True
        )
    assert out.returncode == 1
    assert out.stderr == (
        f"error: cannot write under {bundles} (File too large): free space there (or make it "
        f"writable) and pull again (what arrived is kept in {bundles / '.staging' / 'resume'} for "
        "that pull); nothing was published\n"
    )
    assert sorted(p.name for p in bundles.iterdir()) == [".staging"]


def dripping(sent: list):
    """A registry front that answers every GET with a body it drips, a byte every 0.1 s."""

    class Front(Quiet):
        def do_GET(self):
            self.send_response(200)
            self.send_header("content-length", str(10**15))  # a lie: pacing must not trust it
            self.end_headers()
            try:
                for _ in range(600):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    sent.append(1)
                    time.sleep(0.1)
            except OSError:
                pass

    return Front


def test_a_body_that_drips_ends_in_one_line_not_a_hang(monkeypatch):
    """A byte every few seconds stays under any socket timeout: the pull hung (hours for a tag
    list, days for a block). Past 60 s plus 1 s per 256 KiB the connection is shut (a blob is
    then resumed, up to its tries); here scaled to 0.5 s plus 1 s per 4 MiB of what is expected
    (a Content-Length of 10**15 claimed for the 1 MiB blob allowed ~120 years)."""
    from pipeline.distribute import oci_http

    monkeypatch.setattr(oci_http, "SLOWEST_START_S", 0.5)
    monkeypatch.setattr(oci_http, "SLOWEST_RATE", 4 << 20)
    sent: list = []
    with serving(dripping(sent)) as front:
        registry = client(front)
        registry.sleep = lambda s: None
        try:
            start = time.monotonic()
            with pytest.raises(PipelineError, match="failed after 4 tries"):
                registry.get_blob(DIGEST, len(BLOB))
            with pytest.raises(PipelineError, match=r"listing tags failed \(the connection broke"):
                registry.tags()
            assert time.monotonic() - start < 20
        finally:
            registry.close()


def test_a_head_without_a_length_is_there_and_a_long_redirect_body_is_followed():
    """Found in review of the fixes: a HEAD 200 with no Content-Length stopped a push (it means
    the blob is there); a redirect whose body is over the 1 MiB read was refused, not followed."""
    long = b"<html>" + b"x" * (2 << 20)

    class Front(Quiet):
        def do_HEAD(self):
            self.send_response(200)
            self.send_header("connection", "close")
            self.end_headers()
            self.close_connection = True

        def do_GET(self):
            if self.path.endswith("/moved"):
                return reply(self, 200, BLOB)
            reply(self, 307, long, [("location", "/moved")])

    with serving(Front) as front:
        registry = client(front)
        try:
            assert registry.has_blob(DIGEST) == 0
            assert registry.get_blob(DIGEST, len(BLOB)) == BLOB
        finally:
            registry.close()
