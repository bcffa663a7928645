"""Blob downloads over plain HTTP, each body read straight into a reused buffer.

httpx hands a body over in 64 KiB pieces that h11 copies several times in Python: pulling 1 GB
that way cost ~0.6 s more CPU than this reader (http.client on keep-alive connections, the
socket filling a 1 MiB buffer with recv_into, views of it handed on). It serves plain-HTTP
registries with no proxy set in the environment; TLS, proxies and a redirect to another scheme
stay with httpx (the same trust store and proxy rules as every other request). Transport errors
are raised as httpx's, so the caller's retries see one kind.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urljoin, urlsplit

from pipeline.distribute.oci_http import httpx

CHUNK = 1 << 20
MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)
PROXY_VARS = ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY")


class Unserved(Exception):
    """This reader does not take the request (TLS or a proxy): httpx does."""


def usable(base_url: str) -> bool:
    """Whether blobs under base_url can be read here: plain HTTP, no proxy configured."""
    return base_url.startswith("http://") and not any(os.environ.get(v) for v in PROXY_VARS)


class Response:
    """A blob GET's status and headers, its body read in place."""

    def __init__(self, raw: http.client.HTTPResponse, url: str) -> None:
        self.raw, self.url = raw, url
        self.status_code = raw.status
        self.headers = httpx.Headers(raw.getheaders())
        self._body: bytes | None = None

    def read(self) -> bytes:
        if self._body is None:
            self._body = _transport(self.raw.read)
        return self._body

    def json(self) -> Any:
        return json.loads(self.read())

    def chunks(self, buffer: memoryview) -> Iterator[memoryview]:
        """The body in views of buffer, each valid until the next is asked for."""
        while True:
            n = _transport(self.raw.readinto, buffer)
            if not n:
                return
            yield buffer[:n]


class BlobReader:
    """Keep-alive connections to plain-HTTP hosts, shared by the threads that pull blobs."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.idle: dict[str, list[http.client.HTTPConnection]] = {}
        self.lock = threading.Lock()

    def close(self) -> None:
        with self.lock:
            for conns in self.idle.values():
                for c in conns:
                    c.close()
            self.idle.clear()

    @contextmanager
    def get(self, url: str, headers: dict[str, str]) -> Iterator[Response]:
        """GET url (following plain-HTTP redirects; credentials only to the same host)."""
        headers = dict(headers)
        for _ in range(MAX_REDIRECTS + 1):
            host, conn, raw = self._request(url, headers)
            if raw.status not in REDIRECTS or not raw.getheader("location"):
                break
            _transport(raw.read)
            self._give(host, conn, raw)
            target = urljoin(url, raw.getheader("location", ""))
            if not usable(target):
                raise Unserved(target)
            if urlsplit(target).netloc != host:
                headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            url = target
        response = Response(raw, url)
        done = False
        try:
            yield response
            done = True
        finally:
            if done and raw.isclosed():  # read to its end: the connection can carry another
                self._give(host, conn, raw)
            else:
                conn.close()

    def _request(
        self, url: str, headers: dict[str, str]
    ) -> tuple[str, http.client.HTTPConnection, http.client.HTTPResponse]:
        parts = urlsplit(url)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        for fresh in (False, True):  # an idle connection the server closed: once more, new
            conn = self._take(parts.netloc, fresh)
            try:
                conn.request("GET", path, headers=headers)
                return parts.netloc, conn, conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
                conn.close()
                if fresh:
                    raise httpx.ReadError(f"{e.__class__.__name__}: {e}") from None
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                raise httpx.ConnectError(f"{e.__class__.__name__}: {e}") from None
        raise AssertionError("unreachable")

    def _take(self, host: str, fresh: bool) -> http.client.HTTPConnection:
        with self.lock:
            conns = self.idle.get(host)
            if conns and not fresh:
                return conns.pop()
        return http.client.HTTPConnection(host, timeout=self.timeout)

    def _give(self, host: str, conn: http.client.HTTPConnection, raw: Any) -> None:
        if raw.will_close:
            conn.close()
            return
        with self.lock:
            self.idle.setdefault(host, []).append(conn)


def _transport(fn: Any, *args: Any) -> Any:
    """fn(*args), a broken connection raised as httpx.ReadError (retried by the caller)."""
    try:
        return fn(*args)
    except (OSError, http.client.HTTPException) as e:
        raise httpx.ReadError(f"{e.__class__.__name__}: {e}") from None
