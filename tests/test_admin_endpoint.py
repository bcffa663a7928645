"""serve --admin-port's endpoint, its server object on a free loopback port (no model, no serve):
the token file (what is refused, a rotation), requests a web page may have sent, JSON for every
answer, idle and vanished clients, what the log keeps; and the admin port checks."""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pipeline.format.errors import PipelineError
from pipeline.runtime import admin
from pipeline.runtime.admin import read_token, start_admin

TOKEN = "abcdefghijklmnop-0123"
FIX = "write one line of at least 16 printable ASCII characters to a file only you can read"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def endpoint(token: Any = None, remounter: Any = None, stop: Any = None) -> Iterator[int]:
    """start_admin on a free port; its port, shut down after."""
    port = free_port()
    httpd = start_admin(port, token, remounter or SimpleNamespace(current={}), stop)
    try:
        yield port
    finally:
        httpd.shutdown()
        httpd.server_close()


def call(
    port: int, method: str, path: str, headers: dict | None = None, body: bytes | None = None
) -> tuple[int, dict, dict]:
    """One request: the status, the headers, the JSON body ({} when there is none)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, dict(resp.getheaders()), json.loads(data) if data else {}
    finally:
        conn.close()


@pytest.fixture
def records() -> Iterator[list[str]]:
    """The prefix-bundles log lines while the test runs (serve's logger may not propagate)."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("prefix-bundles")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def private(path: Path, text: str) -> Path:
    path.write_text(text)
    os.chmod(path, 0o600)
    return path


def unusable(kind: str, tmp_path: Path) -> tuple[Path, str]:
    """A token file of `kind` and the start-up error it gets."""
    path = tmp_path / "token"
    if kind == "fifo":
        os.mkfifo(path, 0o600)
        return path, f"--admin-token-file {path}: cannot read a token: it is a FIFO, not a regular file; {FIX}"  # fmt: skip
    if kind == "device":
        path = Path("/dev/null")
        return path, f"--admin-token-file {path}: cannot read a token: it is a character device, not a regular file; {FIX}"  # fmt: skip
    if kind == "folder":
        path.mkdir(mode=0o700)
        return path, f"--admin-token-file {path}: cannot read a token: it is a directory, not a regular file; {FIX}"  # fmt: skip
    if kind == "huge":
        private(path, TOKEN + "\n" + "x" * 5000)
        return path, f"--admin-token-file {path}: cannot read a token: it is 5,022 bytes, over the 4,096-byte limit; {FIX}"  # fmt: skip
    if kind in ("0644", "link to 0666"):
        target = private(tmp_path / "target", TOKEN + "\n")
        os.chmod(target, int(kind[-4:], 8))
        if kind != "0644":
            path.symlink_to(target)
        else:
            path = target
        return path, (
            f"--admin-token-file {path} is open to other users or not yours (mode {kind[-4:]}, "
            f"owner uid {os.getuid()}); the token guards the admin endpoint: use a file of your "
            f"own and fix it with 'chmod 600 {path}'"
        )
    text = {"not ASCII": "é" * 20 + "\n", "control": "\x01" * 20 + "\n", "empty": ""}[kind]
    private(path, text)
    if kind == "empty":
        return path, f"--admin-token-file {path}: the token is 0 characters; use at least 16"
    return path, (
        f"--admin-token-file {path}: the token is not printable ASCII (an HTTP header cannot "
        f"carry it); {FIX}"
    )


@pytest.mark.parametrize(
    "kind",
    ["fifo", "device", "folder", "huge", "0644", "link to 0666", "not ASCII", "control", "empty"],
)
def test_a_token_file_that_is_not_a_small_private_file_of_ascii_is_one_error(
    tmp_path: Path, kind: str
):
    """Before: a FIFO hung start-up (and /dev/zero filled memory), a 0666 file gave every local
    user the token, a non-ASCII token could never authenticate (outside review)."""
    path, expected = unusable(kind, tmp_path)
    outcome: list[Exception | None] = []

    def read() -> None:
        try:
            read_token(path)
            outcome.append(None)
        except Exception as exc:  # noqa: BLE001 - the test reports what it got
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive() and kind == "fifo":  # release a reader blocked on the FIFO
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    assert outcome, "read_token blocked"
    assert isinstance(outcome[0], PipelineError) and str(outcome[0]) == expected


def test_a_rotated_token_takes_over_and_a_deleted_file_refuses_everything(tmp_path: Path):
    """Before: the token read at start-up stayed valid after the file was rotated or deleted."""
    path = private(tmp_path / "token", TOKEN + "\n")
    with endpoint(read_token(path)) as port:

        def status(token: str) -> int:
            return call(port, "GET", "/v1/bundles", {"Authorization": f"Bearer {token}"})[0]

        assert status(TOKEN) == 200 and status("wrong-token-0123456") == 401
        new = "rotated-token-0123456789"
        os.replace(private(tmp_path / "new", new + "\n"), path)
        assert status(TOKEN) == 401 and status(new) == 200
        path.unlink()
        assert call(port, "GET", "/v1/bundles", {"Authorization": f"Bearer {new}"})[::2] == (
            503,
            {"error": "the admin token file is unusable (serve's log says why)"},
        )
        private(path, "x\n")  # back, but unusable: still refused
        assert status(new) == 503


EVIL = "http://evil.example"
FORM = "application/x-www-form-urlencoded"


@pytest.mark.parametrize(
    ("method", "headers", "body", "expected"),
    [
        # what a web page can send without a preflight: refused, nothing stops
        (
            "POST",
            {"Origin": EVIL, "Content-Type": "text/plain;charset=UTF-8"},
            b"",
            (403, f"a request from the web page {EVIL!r} is refused (not a loopback origin)"),
        ),  # fmt: skip
        (
            "POST",
            {"Origin": "null"},
            None,
            (403, "a request from the web page 'null' is refused (not a loopback origin)"),
        ),  # fmt: skip
        (
            "POST",
            {"Content-Type": "text/plain"},
            b"",
            (
                403,
                "a POST with Content-Type text/plain is refused (a web page can send it cross-site); send no body, or application/json",
            ),
        ),  # fmt: skip
        (
            "POST",
            {"Content-Type": "multipart/form-data; boundary=x"},
            b"",
            (
                403,
                "a POST with Content-Type multipart/form-data is refused (a web page can send it cross-site); send no body, or application/json",
            ),
        ),  # fmt: skip
        (
            "POST",
            {"Content-Type": FORM},
            b"a=1",
            (
                403,
                f"a POST with Content-Type {FORM} is refused (a web page can send it cross-site); send no body, or application/json",
            ),
        ),  # fmt: skip
        (
            "POST",
            {"Host": "evil.example:PORT"},
            None,
            (403, "Host 'evil.example:PORT' is not this endpoint's; call http://127.0.0.1:<port>"),
        ),  # fmt: skip
        # what local clients send: curl -X POST, urllib's empty POST, JSON, a loopback page
        ("POST", {}, None, (202, None)),
        ("POST", {"Content-Type": FORM}, b"", (202, None)),
        ("POST", {"Content-Type": "application/json"}, b"{}", (202, None)),
        ("POST", {"Origin": "http://127.0.0.1:PORT", "Host": "localhost:PORT"}, None, (202, None)),
        ("POST", {"Host": "[::1]"}, None, (202, None)),
    ],
)
def test_a_request_a_web_page_may_have_sent_is_refused(
    method: str, headers: dict, body: bytes | None, expected: tuple[int, str | None]
):
    """Before: without a token file any page the operator opened could stop or remount serve (a
    no-preflight fetch got 202) and read GET /v1/bundles by DNS rebinding (outside review)."""
    stops: list[bool] = []
    with endpoint(stop=lambda: stops.append(True)) as port:
        given = {k: v.replace("PORT", str(port)) for k, v in headers.items()}
        status, _, answer = call(port, method, "/v1/stop", given, body)
    error = expected[1] and expected[1].replace("PORT", str(port))
    if expected[0] == 403:
        assert (status, answer, stops) == (403, {"error": error}, [])
    else:
        assert (status, answer, stops) == (202, {"stopping": True}, [True])


def test_a_rebinding_page_cannot_read_the_bundles():
    with endpoint() as port:
        assert call(port, "GET", "/v1/bundles", {"Host": "evil.example"})[0] == 403
        assert call(port, "GET", "/v1/bundles")[::2] == (
            200,
            {"schema": "bundles/1", "mounted": []},
        )


def raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


@pytest.mark.parametrize("method", ["PUT", "DELETE", "OPTIONS", "PATCH", "HEAD"])
def test_other_methods_are_405_json_naming_the_allowed_ones(method: str):
    """Before: 501 with an HTML page."""
    with endpoint() as port:
        status, headers, answer = call(port, method, "/v1/bundles")
    assert status == 405 and headers["Allow"] == "GET, POST"
    assert headers["Content-Type"] == "application/json"
    expected = {} if method == "HEAD" else {"error": f"{method} is not allowed; use GET or POST"}
    assert answer == expected  # HEAD: no body


def test_malformed_requests_are_answered_in_json():
    """Before: http.server's HTML error pages (400, 431)."""
    with endpoint() as port:
        huge = raw(port, b"GET /v1/bundles HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n")
        bad = raw(port, b"GET /v1/bundles HTTP/9\r\n\r\n")  # HTTP/0.9-style: a body only
    head, _, body = huge.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 431") and b"Content-Type: application/json" in head
    assert json.loads(body) == {"error": "Line too long"}
    assert json.loads(bad) == {"error": "Bad request version ('HTTP/9')"}


def test_an_idle_connection_is_closed(monkeypatch: pytest.MonkeyPatch):
    """Before: half-sent requests held a thread each, forever (200 held 219 threads)."""
    monkeypatch.setattr(admin.AdminHandler, "timeout", 0.3)
    with endpoint() as port, socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/bundles/remount HTTP/1.1\r\nAuthorization: Bearer")
        start = time.monotonic()
        assert s.recv(100) == b"" and time.monotonic() - start < 5  # closed by the server


def test_a_client_gone_before_the_answer_is_one_log_line(
    records: list[str], capfd: pytest.CaptureFixture[str]
):
    """Before: a BrokenPipeError traceback of many lines on serve's stderr."""
    started, closed = threading.Event(), threading.Event()

    def remount() -> None:
        started.set()
        closed.wait(10)
        raise RuntimeError("no bundles folder")

    with endpoint(remounter=SimpleNamespace(remount=remount)) as port:
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"POST /v1/bundles/remount HTTP/1.0\r\n\r\n")
        assert started.wait(10)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # a reset: the answer's write fails
        closed.set()
        deadline = time.monotonic() + 10
        gone = "admin: the client closed the connection before the 500 answer"
        while gone not in records and time.monotonic() < deadline:
            time.sleep(0.02)
    assert gone in records and "Traceback" not in capfd.readouterr().err


def test_the_query_string_is_never_logged(records: list[str]):
    """Before: `?token=...` was logged in the access line."""
    with endpoint() as port:
        assert call(port, "GET", "/v1/bundles?token=s3cret-in-the-query")[0] == 200
    assert "admin: GET /v1/bundles 200" in records
    assert not [line for line in records if "s3cret" in line]


def test_the_admin_port_cannot_be_the_servers_port():
    """Before: accepted; the admin endpoint took the port and serve died after loading."""
    from pipeline.runtime.servers.options import ServeOptions, check_admin

    port = free_port()
    given = ServeOptions("mlx-lm", Path("m"), Path("b"), ("--port", str(port)), (), False)
    with pytest.raises(PipelineError) as given_port:
        check_admin(ServeOptions(**{**given.__dict__, "admin_port": port}))
    assert str(given_port.value) == (
        f"--admin-port {port} is also the server's port (--port); the two cannot share it: "
        "pass another --admin-port or --port (nothing was loaded or mounted)"
    )
    default = ServeOptions("mlx-lm", Path("m"), Path("b"), (), (), False, admin_port=8080)
    with pytest.raises(PipelineError, match=r"port \(mlx-lm's default; no --port given\)"):
        check_admin(default)
