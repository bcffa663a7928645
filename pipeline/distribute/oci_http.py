"""The one HTTP transport of the OCI client: httpx, for plain HTTP and TLS alike.

huggingface_hub 1.x depends on `httpx`, 2.x on its successor `httpx2` (the same API); both are
maintained and one is always installed with this project. Here: the client (TLS verified by the
system store or a CA bundle), the scheme a registry speaks (loopback: HTTPS first, plain HTTP
when the port answers in plain HTTP, as Docker does), what a wrong scheme looks like, and a body
paced by what the caller will take (a registry that drips a byte every few seconds stays under
any socket timeout).
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from pipeline.format.errors import PipelineError

try:
    import httpx2 as httpx
except ImportError:  # huggingface_hub 1.x
    import httpx  # type: ignore[no-redef]

MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)
# the slowest body taken: 60 s plus 1 s per 256 KiB (a socket timeout bounds one wait, not a body
# that drips a byte every few seconds); past it the body is refused, and a blob resumes
SLOWEST_START_S, SLOWEST_RATE = 60.0, 256 << 10
Body = bytes | Sequence[Any]  # bytes, or buffers sent one after another (views of a block)
# what OpenSSL says when the other end answers a ClientHello in plain HTTP
NOT_TLS = {"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST"}
TLS_ANSWER = b"Client sent an HTTP request to an HTTPS server"  # Go's net/http, on a TLS port


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
    return httpx.Client(verify=verify, timeout=httpx.Timeout(60.0, connect=10.0))


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


__all__ = ["Body", "client", "httpx", "paced", "probe_plain"]
