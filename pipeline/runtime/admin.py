"""The opt-in admin endpoint of `serve --admin-port N`: re-mount the bundles over HTTP.

A small HTTP server of its own on the loopback interface only (whatever server serve wraps, and
whatever address that server listens on), in a daemon thread:

  POST /v1/bundles/remount   re-read --bundles as SIGHUP does; 200 with the JSON report
                             (RemountReport, "remount/2": `schema remount`)
  GET  /v1/bundles           what is mounted; 200 with BundlesReport ("bundles/1": `schema bundles`)
  POST /v1/stop              a graceful stop, as SIGTERM to serve's process (202 {"stopping":
                             true}): the server stops, and with --snapshots saves them first

With --admin-token-file F every request must carry `Authorization: Bearer <the file's first
line>` (401 otherwise). A failed remount answers 500 with its error; what was mounted stays.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.format.errors import PipelineError
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


def read_token(path: Path | None) -> str | None:
    """The admin token: the file's first line; PipelineError naming the file when unusable."""
    if path is None:
        return None
    try:
        token = Path(path).read_text().strip().splitlines()[0].strip()
    except (OSError, UnicodeDecodeError, IndexError) as exc:
        raise PipelineError(
            f"--admin-token-file {path}: cannot read a token from it ({exc.__class__.__name__}); "
            "write one line of at least 16 characters"
        ) from None
    if len(token) < 16:
        raise PipelineError(
            f"--admin-token-file {path}: the token is {len(token)} characters; use at least 16"
        )
    return token


def start_admin(
    port: int, token: str | None, remounter: Remounter, stop: Any = None
) -> ThreadingHTTPServer:
    """Serve the admin endpoint on HOST:port in a daemon thread; PipelineError if it cannot bind.
    `stop()` begins a graceful stop of serve (None: /v1/stop is not offered)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
            log.info("admin: %s", format % args)

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = (json.dumps(body, indent=2) + "\n").encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _allowed(self) -> bool:
            if token is None:
                return True
            given = self.headers.get("Authorization", "")
            if hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return True
            self._answer(401, {"error": "missing or wrong Authorization: Bearer <token>"})
            return False

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if not self._allowed():
                return
            if self.path.rstrip("/") != "/v1/bundles":
                self._answer(404, {"error": f"no {self.path}; GET /v1/bundles"})
                return
            self._answer(200, BundlesReport(mounted=mounted(remounter)).model_dump(by_alias=True))

        def do_POST(self) -> None:  # noqa: N802
            if not self._allowed():
                return
            if self.path.rstrip("/") == "/v1/stop" and stop is not None:
                log.warning("admin: a graceful stop was asked for")
                self._answer(202, {"stopping": True})
                stop()
                return
            if self.path.rstrip("/") != "/v1/bundles/remount":
                routes = "POST /v1/bundles/remount" + (", POST /v1/stop" if stop else "")
                self._answer(404, {"error": f"no {self.path}; {routes}"})
                return
            try:
                changes = remounter.remount()
            except Exception as exc:  # noqa: BLE001 - a failed remount leaves what was mounted
                log.error("remount failed (%s); the mounted bundles stay", exc)
                self._answer(500, {"error": f"remount failed: {exc}; the mounted bundles stay"})
                return
            changes.log(log)
            self._answer(200, report(changes, remounter))

    try:
        httpd = ThreadingHTTPServer((HOST, port), Handler)
    except OSError as exc:
        raise PipelineError(
            f"--admin-port {port}: cannot listen on {HOST}:{port} ({exc.strerror}); choose a free "
            "port"
        ) from None
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="prefix-bundles-admin", daemon=True).start()
    log.info(
        "admin endpoint on http://%s:%d (POST /v1/bundles/remount, GET /v1/bundles%s)%s",
        HOST,
        port,
        ", POST /v1/stop" if stop else "",
        "; a bearer token is required" if token else "",
    )
    return httpd


__all__ = ["read_token", "report", "start_admin"]
