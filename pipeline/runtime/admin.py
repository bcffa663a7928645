"""The opt-in admin endpoint of `serve --admin-port N`: re-mount the bundles over HTTP.

A small HTTP server of its own on the loopback interface only (whatever server serve wraps, and
whatever address that server listens on), in a daemon thread:

  POST /v1/bundles/remount   re-read --bundles as SIGHUP does; 200 with the JSON report
                             (RemountReport, "remount/2": `schema remount`)
  GET  /v1/bundles           what is mounted; 200 with BundlesReport ("bundles/1": `schema bundles`)
  POST /v1/stop              a graceful stop, as SIGTERM to serve's process (202 {"stopping":
                             true}): the server stops, and with --snapshots saves them first

With --admin-token-file F every request must carry `Authorization: Bearer <the file's first
line>` (401 otherwise); F (mode 0600) is read again when it changes, and while it is gone or
unusable every request is refused (503). A request a web page may have sent is refused (403): a
Host or an Origin that is not loopback's, a POST typed as text/plain or a form. A failed remount
answers 500 with its error; what was mounted stays. Every answer is JSON.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.format.errors import PipelineError
from pipeline.runtime.admin_token import TokenFile, read_token
from pipeline.runtime.remount import Changes, Remounter

log = logging.getLogger("prefix-bundles")
HOST = "127.0.0.1"


class _Strict(BaseModel):
    model_config = ConfigDict(
        extra="forbid", strict=True, json_schema_serialization_defaults_required=True
    )


class MountedBundleInfo(_Strict):
    name: str = Field(description="<prefix>@<version>/<model folder>")
    tokens: int = Field(description="prefix tokens the bundle holds")
    path: str


class ServedPrefix(_Strict):
    name: str = Field(description="the bundle now served for this prefix")
    why: str = Field(description="added, replaced <old>, unchanged, or why the old one stays")


class PathReason(_Strict):
    path: str
    reason: str


class Replacement(_Strict):
    old: str
    new: str


class BundlesReport(_Strict):
    """GET /v1/bundles: what is mounted."""

    schema_: Literal["bundles/1"] = Field("bundles/1", alias="schema")
    mounted: list[MountedBundleInfo]


class RemountReport(_Strict):
    """POST /v1/bundles/remount: what the remount did, and every prefix it serves and why."""

    schema_: Literal["remount/2"] = Field("remount/2", alias="schema")
    added: list[str]
    replaced: list[Replacement]
    removed: list[str]
    kept: list[str] = Field(description="still served: unchanged, or its new version not taken")
    refused: list[PathReason] = Field(description="refused by the validator; the old one stays")
    unused: list[PathReason] = Field(
        description="valid, but the server's options cannot use it; the old one stays"
    )
    serving: list[ServedPrefix] = Field(description="every prefix served after the remount")
    mounted: list[MountedBundleInfo]


def report(changes: Changes, remounter: Remounter) -> dict[str, Any]:
    """The remount's JSON report (RemountReport)."""
    return RemountReport(
        added=changes.added,
        replaced=[Replacement(old=a, new=b) for a, b in changes.replaced],
        removed=changes.removed,
        kept=changes.kept,
        refused=[PathReason(path=str(r.path), reason=r.reason) for r in changes.refused],
        unused=[PathReason(path=str(p), reason=why) for p, why in changes.unused],
        serving=[ServedPrefix(name=n, why=why) for n, why in sorted(changes.serving)],
        mounted=mounted(remounter),
    ).model_dump(by_alias=True)


def mounted(remounter: Remounter) -> list[MountedBundleInfo]:
    return [
        MountedBundleInfo(name=b.name, tokens=len(b.tokens), path=str(b.path))
        for b in sorted(remounter.current.values(), key=lambda b: b.name)
    ]


IDLE_SECONDS = 15  # a connection silent this long is closed (half-sent requests hold threads)
LOOPBACK = re.compile(r"(127\.0\.0\.1|localhost|\[::1\])(:[0-9]{1,5})?", re.IGNORECASE)
LOOPBACK_ORIGIN = re.compile(r"https?://" + LOOPBACK.pattern, re.IGNORECASE)
# what a web page may POST anywhere without a CORS preflight (an HTML form, a no-cors fetch)
FORM_TYPES = ("text/plain", "multipart/form-data", "application/x-www-form-urlencoded")


class AdminServer(ThreadingHTTPServer):
    """The endpoint's server: what its handler answers with, and one log line per failure."""

    daemon_threads = True

    def __init__(self, port: int, token: str | TokenFile | None, remounter: Any, stop: Any):
        self.token, self.remounter, self.stop = token, remounter, stop
        super().__init__((HOST, port), AdminHandler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client gone or too slow is not a bug: one line, no traceback
        log.warning("admin: a request from %s failed (%s)", client_address[0], sys.exc_info()[1])


class AdminHandler(BaseHTTPRequestHandler):
    timeout = IDLE_SECONDS
    server: AdminServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        log.info("admin: %s", format % args)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        # the path only: a query may carry a secret (?token=...)
        path = getattr(self, "path", "").split("?", 1)[0]
        log.info("admin: %s %s %s", self.command or "-", path[:200], code)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None):
        """http.server's own refusals (a malformed request, huge headers, a method it has no
        do_ for) as JSON; an unknown method is 405 naming the two there are."""
        self.close_connection = True
        if code == 501:
            message, code = f"{self.command} is not allowed; use GET or POST", 405
        self._answer(code, {"error": message or self.responses[code][0]})

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = (json.dumps(body, indent=2) + "\n").encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 405:
                self.send_header("Allow", "GET, POST")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            log.warning("admin: the client closed the connection before the %d answer", status)

    def _refusal(self) -> str | None:
        """Why a request that a web page may have sent is refused (a cross-site request, a DNS
        rebinding), None for a local client's."""
        host, origin = self.headers.get("Host"), self.headers.get("Origin")
        if host is not None and not LOOPBACK.fullmatch(host):
            return f"Host {host[:100]!r} is not this endpoint's; call http://{HOST}:<port>"
        if origin is not None and not LOOPBACK_ORIGIN.fullmatch(origin):
            return (
                f"a request from the web page {origin[:100]!r} is refused (not a loopback origin)"
            )
        kind = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        # urllib types an empty POST as a form: only a form with a body is a web page's
        body = "Transfer-Encoding" in self.headers or self.headers.get("Content-Length", "0") != "0"
        if self.command == "POST" and kind in FORM_TYPES and (body or kind != FORM_TYPES[-1]):
            return (
                f"a POST with Content-Type {kind[:60]} is refused (a web page can send it "
                "cross-site); send no body, or application/json"
            )
        return None

    def _allowed(self) -> bool:
        if (why := self._refusal()) is not None:
            self._answer(403, {"error": why})
            return False
        token = self.server.token
        try:
            expected = token.current() if isinstance(token, TokenFile) else token
        except PipelineError as exc:
            log.error("admin: %s; every request is refused until it is fixed", exc)
            self._answer(503, {"error": "the admin token file is unusable (serve's log says why)"})
            return False
        if expected is None:
            return True
        given = self.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {expected}".encode()):
            return True
        self._answer(401, {"error": "missing or wrong Authorization: Bearer <token>"})
        return False

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if not self._allowed():
            return
        route = self.path.split("?", 1)[0].rstrip("/")
        if route != "/v1/bundles":
            self._answer(404, {"error": f"no {route[:200]}; GET /v1/bundles"})
            return
        listing = BundlesReport(mounted=mounted(self.server.remounter))
        self._answer(200, listing.model_dump(by_alias=True))

    def do_POST(self) -> None:  # noqa: N802
        if not self._allowed():
            return
        route, stop = self.path.split("?", 1)[0].rstrip("/"), self.server.stop
        if route == "/v1/stop" and stop is not None:
            log.warning("admin: a graceful stop was asked for")
            self._answer(202, {"stopping": True})
            stop()
            return
        if route != "/v1/bundles/remount":
            routes = "POST /v1/bundles/remount" + (", POST /v1/stop" if stop else "")
            self._answer(404, {"error": f"no {route[:200]}; {routes}"})
            return
        try:
            changes = self.server.remounter.remount()
        except Exception as exc:  # noqa: BLE001 - a failed remount leaves what was mounted
            log.error("remount failed (%s); the mounted bundles stay", exc)
            self._answer(500, {"error": f"remount failed: {exc}; the mounted bundles stay"})
            return
        changes.log(log)
        self._answer(200, report(changes, self.server.remounter))


def start_admin(
    port: int, token: str | TokenFile | None, remounter: Remounter, stop: Any = None
) -> ThreadingHTTPServer:
    """Serve the admin endpoint on HOST:port in a daemon thread; PipelineError if it cannot bind.
    `stop()` begins a graceful stop of serve (None: /v1/stop is not offered)."""
    try:
        httpd = AdminServer(port, token, remounter, stop)
    except OSError as exc:
        raise PipelineError(
            f"--admin-port {port}: cannot listen on {HOST}:{port} ({exc.strerror}); choose a free "
            "port"
        ) from None
    threading.Thread(target=httpd.serve_forever, name="prefix-bundles-admin", daemon=True).start()
    log.info(
        "admin endpoint on http://%s:%d (POST /v1/bundles/remount, GET /v1/bundles%s)%s",
        HOST,
        port,
        ", POST /v1/stop" if stop else "",
        "; a bearer token is required" if token else "",
    )
    return httpd


__all__ = ["TokenFile", "read_token", "report", "start_admin"]
