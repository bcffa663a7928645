"""Requests to a plain-HTTP registry over http.client: bodies read in place and sent from the
caller's buffers.

httpx hands a body over in 64 KiB pieces that h11 copies several times in Python, and joins an
upload into one more copy: pulling 1 GB that way cost ~0.6 s more CPU than reading it here (the
socket filling a 1 MiB buffer with recv_into, views of it handed on), and importing httpcore
(which imports trio) ~0.1 s more per process. This transport serves plain-HTTP registries with
no proxy set in the environment, on keep-alive connections shared by the threads that move
blobs; TLS, proxies and a blob redirected to another scheme stay with httpx (the same trust store
and proxy rules as before). Transport errors are raised as httpx's (imported only then), so retries
see one kind.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlencode, urljoin, urlsplit

from pipeline.distribute.oci_http import lib
from pipeline.distribute.untrusted import same_origin

CHUNK = 1 << 20
MAX_READ = 1 << 20  # a body read whole here: a redirect's, an error's (blobs and documents stream)
# the slowest body taken: 60 s plus 1 s per 256 KiB (a socket timeout bounds one wait, not a body
# that drips a byte every few seconds); past it the connection is shut, and a blob resumes
SLOWEST_START_S, SLOWEST_RATE = 60.0, 256 << 10
UNKNOWN_LENGTH = 16 << 20  # a body with no Content-Length is paced as if it were this long
MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)
PROXY_VARS = ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY")
Body = bytes | Sequence[Any]  # bytes, or buffers sent one after another (views of a block)


class Unserved(Exception):
    """This transport does not take the request (a redirect to TLS): httpx does."""


def usable(base_url: str) -> bool:
    """Whether requests under base_url can go here: plain HTTP, no proxy configured."""
    return base_url.startswith("http://") and not any(os.environ.get(v) for v in PROXY_VARS)


class URL(str):
    """A response's URL: `join` resolves a reference (a Location, a Link) against it."""

    def join(self, reference: str) -> URL:
        return URL(urljoin(self, reference))


class Headers(dict):
    """Response headers by lower-case name (a repeated header's values joined with ", ", as
    httpx does); `get` and `[]` take any case."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        super().__init__()
        for k, v in pairs:
            k = k.lower()
            super().__setitem__(k, f"{super().__getitem__(k)}, {v}" if k in self else v)

    def get(self, name: str, default: Any = None) -> Any:
        return super().get(name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return super().__getitem__(name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and super().__contains__(name.lower())


class Response:
    """Status and headers of one response; its body read whole, in pieces, or into a buffer.
    Closing it hands its connection back for the next request when the body was read to its end."""

    def __init__(self, owner: PlainHTTP, conn: Any, raw: http.client.HTTPResponse, url: str):
        self.owner, self.conn, self.raw = owner, conn, raw
        self.url = URL(url)
        self.status_code = raw.status
        self.headers = Headers(raw.getheaders())
        self._body: bytes | None = None
        self.too_slow = False  # set by the watchdog when it shut the connection

    def read(self, cap: int = MAX_READ) -> bytes:
        """The body, or its first `cap` bytes when it is longer (what a registry says in a
        redirect or an error is small; the rest is dropped with the connection)."""
        if self._body is None:
            with self.owner.watching(self, cap):
                data = _transport(self.raw.read, cap + 1)
            if len(data) <= cap:  # read to its end (a longer one is cut: nothing more is owed)
                self._check_ended()
            self._body = data[:cap]
        return self._body

    def json(self) -> Any:
        return json.loads(self.read())

    def iter_bytes(
        self, chunk_size: int = CHUNK, expected: int = UNKNOWN_LENGTH
    ) -> Iterator[bytes]:
        """The body in pieces; `expected`: the most the caller will take (paces the read: a
        Content-Length the server claims does not)."""
        with self.owner.watching(self, expected):
            while data := _transport(self.raw.read, chunk_size):
                yield data
        self._check_ended()

    def chunks(self, buffer: memoryview, expected: int = UNKNOWN_LENGTH) -> Iterator[memoryview]:
        """The body in views of buffer, each valid until the next is asked for."""
        with self.owner.watching(self, expected):
            while n := _transport(self.raw.readinto, buffer):
                yield buffer[:n]
        self._check_ended()

    def _check_ended(self) -> None:
        """A body that ended before its Content-Length: the connection closed early (http.client
        returns what came, not an error), or the watchdog shut it (too slow); raised as a broken
        connection for the caller to retry."""
        if self.too_slow:
            raise lib().ReadTimeout(
                f"the body came slower than {SLOWEST_RATE >> 10} KiB/s (after "
                f"{SLOWEST_START_S:g} s): its connection was shut"
            )
        if self.raw.length:  # bytes it still owed
            raise lib().ReadError(
                f"the connection closed {self.raw.length:,} bytes before the body ended"
            )

    def close(self) -> None:
        if self.conn is None:
            return
        conn, self.conn = self.conn, None
        ended = self.raw.isclosed() and not self.raw.length  # read to its end, nothing owed
        if ended and not self.raw.will_close and not self.too_slow:  # reusable
            self.owner.give(conn)
        else:
            conn.close()

    def __enter__(self) -> Response:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class PlainHTTP:
    """Keep-alive connections to one plain-HTTP registry host (and hosts it redirects blobs
    to), shared by threads."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.idle: dict[str, list[http.client.HTTPConnection]] = {}
        self.lock = threading.Lock()
        self.watched: dict[int, tuple[float, Response]] = {}  # bodies being read, by deadline
        self.watchdog: threading.Thread | None = None
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()
        with self.lock:
            for conns in self.idle.values():
                for c in conns:
                    c.close()
            self.idle.clear()

    @contextmanager
    def watching(self, r: Response, expected: int) -> Iterator[None]:
        """While r's body (at most `expected` bytes taken) is read: past its allowed time, its
        connection is shut (the read then ends short, and _check_ended says why)."""
        with self.lock:
            self.watched[id(r)] = (time.monotonic() + allowed_seconds(expected), r)
            if self.watchdog is None:
                self.watchdog = threading.Thread(target=self._watch, daemon=True)
                self.watchdog.start()
        try:
            yield
        finally:
            with self.lock:
                self.watched.pop(id(r), None)

    def _watch(self) -> None:
        while not self.closed.wait(0.25):
            now = time.monotonic()
            with self.lock:  # under the lock: a response still watched has not closed yet
                for deadline, r in list(self.watched.values()):
                    if deadline < now and r.raw.length != 0:  # bytes still owed
                        del self.watched[id(r)]
                        r.too_slow = True  # its connection is never handed back (close)
                        sock = getattr(r.conn, "sock", None)
                        if sock is not None:
                            try:
                                sock.shutdown(socket.SHUT_RDWR)
                            except OSError:
                                pass

    def send(
        self,
        method: str,
        url: str,
        headers: dict[str, str],
        *,
        params: dict[str, str] | None = None,
        content: Body | None = None,
        stream: bool = False,
        follow: bool = False,
    ) -> Response:
        """One request; `stream`: the body left unread (the caller closes the response);
        `follow`: plain-HTTP redirects followed, credentials kept for the same origin only."""
        if params:
            url = f"{url}{'&' if '?' in url else '?'}{urlencode(params)}"
        headers = dict(headers)
        if content is not None:
            size = len(content) if isinstance(content, bytes) else sum(len(b) for b in content)
            headers["content-length"] = str(size)
        elif method in ("POST", "PUT", "PATCH"):  # as httpx sends it: some proxies want one
            headers["content-length"] = "0"
        for _ in range(MAX_REDIRECTS + 1):
            r = self._once(method, url, headers, content)
            target = r.headers.get("location")
            if not (follow and r.status_code in REDIRECTS and target):
                break
            r.read()  # capped: a longer body drops the connection
            r.close()
            target = urljoin(url, target)
            if not usable(target):
                raise Unserved(target)
            if not same_origin(target, url):
                headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            url = target
        if not stream:
            r.read()
            r.close()
        return r

    def _once(self, method: str, url: str, headers: dict[str, str], content: Any) -> Response:
        parts = urlsplit(url)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        for reused in (True, False):  # an idle connection the server closed: once more, new
            conn, was_idle = self._take(parts.netloc, reused)
            try:
                conn.putrequest(method, path, skip_accept_encoding=True)
                for k, v in headers.items():
                    conn.putheader(k, v)
                conn.endheaders()
                for piece in [content] if isinstance(content, bytes) else content or ():
                    conn.send(piece)
                return Response(self, conn, conn.getresponse(), url)
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
                conn.close()
                if not was_idle:
                    raise lib().ReadError(f"{e.__class__.__name__}: {e}") from None
            except (OSError, http.client.HTTPException, ValueError) as e:
                # ValueError: a URL or header value the registry named that cannot be sent
                conn.close()
                raise lib().ConnectError(f"{e.__class__.__name__}: {e}") from None
        raise AssertionError("unreachable")

    def _take(self, host: str, reused: bool) -> tuple[http.client.HTTPConnection, bool]:
        with self.lock:
            conns = self.idle.get(host)
            if conns and reused:
                return conns.pop(), True
        conn = http.client.HTTPConnection(host, timeout=self.timeout)
        conn.pool_key = host  # type: ignore[attr-defined]
        return conn, False

    def give(self, conn: http.client.HTTPConnection) -> None:
        with self.lock:
            self.idle.setdefault(conn.pool_key, []).append(conn)  # type: ignore[attr-defined]


def allowed_seconds(expected: int) -> float:
    """How long a body the caller takes at most `expected` bytes of may take to arrive."""
    return SLOWEST_START_S + expected / SLOWEST_RATE


def paced(chunks: Iterable[Any], expected: int) -> Iterator[Any]:
    """chunks, refused once they take past allowed_seconds(expected) (httpx's reads return what
    has come, so a check between them bounds a body that drips)."""
    deadline = time.monotonic() + allowed_seconds(expected)
    for chunk in chunks:
        if time.monotonic() > deadline:
            raise lib().ReadTimeout(
                f"the body came slower than {SLOWEST_RATE >> 10} KiB/s (after "
                f"{SLOWEST_START_S:g} s)"
            )
        yield chunk


def _transport(fn: Any, *args: Any) -> Any:
    """fn(*args), a broken connection raised as httpx.ReadError (retried by the caller)."""
    try:
        return fn(*args)
    except (OSError, http.client.HTTPException) as e:
        raise lib().ReadError(f"{e.__class__.__name__}: {e}") from None
