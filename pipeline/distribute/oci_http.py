"""The one HTTP transport of the OCI client: httpx, for plain HTTP and TLS alike.

huggingface_hub 1.x depends on `httpx`, 2.x on its successor `httpx2` (the same API); both are
maintained and one is always installed with this project. Here: the client (TLS verified by the
system store or a CA bundle; its TLS reads take every record already arrived), the scheme a
registry speaks (loopback: HTTPS first, plain HTTP when the port answers in plain HTTP, as Docker
does), what a wrong scheme looks like, and a body paced by what the caller will take (a registry
that drips a byte every few seconds stays under any socket timeout).
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from pipeline.distribute.untrusted import read_capped
from pipeline.format.errors import PipelineError

try:
    import httpcore2 as httpcore
    import httpx2 as httpx
except ImportError:  # huggingface_hub 1.x
    import httpcore  # type: ignore[no-redef]
    import httpx  # type: ignore[no-redef]

RETRIES = 4  # a request, or a blob from where it broke
MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)
# the slowest body taken: 60 s plus 1 s per 256 KiB (a socket timeout bounds one wait, not a body
# that drips a byte every few seconds); past it the body is refused, and a blob resumes
SLOWEST_START_S, SLOWEST_RATE = 60.0, 256 << 10
Body = bytes | Sequence[Any]  # bytes, or buffers sent one after another (views of a block)
# what OpenSSL says when the other end answers a ClientHello in plain HTTP
NOT_TLS = {"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST"}
TLS_ANSWER = b"Client sent an HTTP request to an HTTPS server"  # Go's net/http, on a TLS port
MAX_SMALL_BODY = 64 << 10  # what is read of a body only its message needs (an error, a PUT's)


def client(verify: bool | str) -> Any:
    """An httpx client: `verify` True (the system's CAs), a CA bundle file, or False (plain)."""
    if isinstance(verify, str):
        try:
            verify = ssl.create_default_context(cafile=verify)
        except (OSError, ssl.SSLError) as exc:  # missing, unreadable, or no PEM certificate
            why = getattr(exc, "strerror", None) or " ".join(str(exc).split())[:80]
            raise PipelineError(
                f"--ca-bundle {verify}: cannot be read as PEM CA certificates ({why}); pass the "
                "file holding the CA that signed the registry's certificate"
            ) from None
    c = httpx.Client(verify=verify, timeout=httpx.Timeout(60.0, connect=10.0))
    # httpx takes no network backend; its pool holds httpcore's (both attributes there since
    # httpx 0.18 / httpcore 0.14): elsewhere reads stay one TLS record each, only slower
    pool = getattr(getattr(c, "_transport", None), "_pool", None)
    if isinstance(pool, httpcore.ConnectionPool) and hasattr(pool, "_network_backend"):
        pool._network_backend = Backend()
    return c


class Records(httpcore.NetworkStream):
    """httpcore's connection, whose TLS reads also take the records already arrived, up to the
    bytes asked for. A TLS body comes in records of at most 16 KiB, one per SSL read, and each
    read costs h11, httpcore and httpx a Python event per piece: 0.64-0.71 s of CPU per 256 MiB
    against curl's 0.30, most of a pull's CPU (docs/deploy.md). Only what has arrived is taken
    (the socket is non-blocking meanwhile): a body that drips still comes a piece at a time,
    paced by the caller; a record not yet whole stays for the next read. Plain HTTP, and TLS
    inside a proxy's TLS, are read as httpcore reads them."""

    def __init__(self, stream: Any, tls: bool = False) -> None:
        self.stream, self.tls = stream, tls

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        first = self.stream.read(max_bytes, timeout)  # waits as httpcore waits, errors mapped
        sock = self.stream.get_extra_info("socket") if self.tls else None
        if not first or len(first) >= max_bytes or not isinstance(sock, ssl.SSLSocket):
            return first
        parts, n = [first], len(first)
        sock.settimeout(0.0)
        try:
            while n < max_bytes:
                try:
                    more = sock.recv(max_bytes - n)
                except OSError:  # nothing whole has come (SSLWantReadError), or an error
                    break  # that the next read raises, mapped by httpcore
                if not more:
                    break
                parts.append(more)
                n += len(more)
        finally:
            sock.settimeout(timeout)
        return b"".join(parts) if len(parts) > 1 else first

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.stream.write(buffer, timeout)

    def close(self) -> None:
        self.stream.close()

    def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> Records:
        # TLS over this TCP connection: its socket is the SSL one; TLS inside TLS is not
        return Records(self.stream.start_tls(ssl_context, server_hostname, timeout), not self.tls)

    def get_extra_info(self, info: str) -> Any:
        return self.stream.get_extra_info(info)


class Backend(httpcore.SyncBackend):
    """httpcore's network backend, its connections Records."""

    def connect_tcp(self, *args: Any, **kwargs: Any) -> Records:
        return Records(super().connect_tcp(*args, **kwargs))


def tls_failure(exc: BaseException) -> str | None:
    """Why a TLS connection failed where no retry helps: "plain" (the port speaks plain HTTP),
    "untrusted" (its certificate), else None."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return "untrusted"
        if isinstance(seen, ssl.SSLError):
            return "plain" if getattr(seen, "reason", None) in NOT_TLS else None
        seen = seen.__cause__ or seen.__context__
    return None


def probe_plain(origin: str) -> bool:
    """Whether the https `origin`'s port answers in plain HTTP (any other outcome, an error
    included, leaves HTTPS: the first real request then says what failed). Nothing is sent but
    a handshake's hello: no certificate is checked, so no CA store is loaded (~25 ms)."""
    try:
        with client(False) as c, c.stream("GET", f"{origin}/v2/"):
            return False
    except httpx.RequestError as exc:
        return tls_failure(exc) == "plain"


def allowed_seconds(expected: int) -> float:
    """How long a body the caller takes at most `expected` bytes of may take to arrive."""
    return SLOWEST_START_S + expected / SLOWEST_RATE


def paced(chunks: Iterable[Any], expected: int) -> Iterator[Any]:
    """chunks, refused once they take past allowed_seconds(expected) (httpx's reads return what
    has come, so a check between them bounds a body that drips)."""
    deadline = time.monotonic() + allowed_seconds(expected)
    for chunk in chunks:
        if time.monotonic() > deadline:
            raise httpx.ReadTimeout(
                f"the body came slower than {SLOWEST_RATE >> 10} KiB/s (after "
                f"{SLOWEST_START_S:g} s)"
            )
        yield chunk


def pieces(r: Any, expected: int) -> Iterator[Any]:
    """A response's body as it comes, of which at most `expected` bytes will be taken: paced
    by that (a body that drips ends), not by the length the server claims; an error's body,
    already read for its message (small_body), is that."""
    if getattr(r, "small_body", None) is not None:  # a stream is read once
        return iter([r.small_body])
    return paced(r.iter_bytes(), expected)


def small_body(r: Any) -> bytes:
    """A response's body as far as a message needs it: at most MAX_SMALL_BODY bytes (a longer
    one is cut, and its connection dropped when the response closes); kept on the response."""
    body = getattr(r, "small_body", None)
    if body is None:
        try:
            body = read_capped(pieces(r, MAX_SMALL_BODY + 1), MAX_SMALL_BODY)[:MAX_SMALL_BODY]
        except httpx.RequestError:
            body = b""  # a broken answer: its message is its status
        r.small_body = body
    return body


def error_detail(r: Any) -> str:
    try:
        errors = json.loads(small_body(r)).get("errors") or []
        text = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors)
    except Exception:
        text = ""
    return f" ({' '.join(text.split())[:160]})" if text else ""


__all__ = [
    "Body",
    "client",
    "error_detail",
    "httpx",
    "paced",
    "pieces",
    "probe_plain",
    "small_body",
]
