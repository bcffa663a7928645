"""What a registry, a credential helper or a token service hands back, read as untrusted input.

One way to read a document: its size capped before it is parsed, its JSON nested no deeper than
pydantic's parser goes (Python's own json raises RecursionError at ~1,000 levels, a traceback),
and its fields validated by a strict model. One rule for URLs a registry names (a redirect, a
`Location`, a `Link`): credentials go only to the origin they were given for, and to the token
service a Bearer challenge names only as `may_carry_credentials` allows.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from pydantic import TypeAdapter, ValidationError

T = TypeVar("T")
DEFAULT_PORTS = {"http": 80, "https": 443}


class Unfit(ValueError):
    """A document that is not what it should be; str() says why in a few words, `errors` are
    pydantic's (none when it was over its cap)."""

    def __init__(self, why: str, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(why)
        self.errors = errors or []


def read_capped(chunks: Iterable[Any], cap: int) -> bytes:
    """The pieces joined, stopping one piece past cap (over cap: the caller refuses or cuts it;
    the rest is never read)."""
    parts, n = [], 0
    for chunk in chunks:
        parts.append(bytes(chunk))
        n += len(chunk)
        if n > cap:
            break
    return b"".join(parts)


def parse_as(kind: type[T] | TypeAdapter[T], data: bytes, cap: int) -> T:
    """data as `kind` (a pydantic model, or a TypeAdapter), strictly; Unfit saying what is
    wrong (over the cap, not JSON, nested too deep, the first field that does not fit)."""
    if len(data) > cap:
        raise Unfit(f"{len(data):,} bytes, over the {cap:,} it may have")
    adapter = kind if isinstance(kind, TypeAdapter) else TypeAdapter(kind)
    try:
        return adapter.validate_json(data, strict=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        raise Unfit(first_error(errors[0]), errors) from None


def first_error(e: dict[str, Any]) -> str:
    """One pydantic error as a few words: 'not JSON (...)' or 'field: why'."""
    if e["type"] == "json_invalid":
        return f"not JSON ({' '.join(e['msg'].removeprefix('Invalid JSON: ').split())[:80]})"
    # the path may hold keys from the document: escaped, so one line stays one line
    where = repr(".".join(str(p) for p in e["loc"]))[1:-1][:60]
    why = " ".join(e["msg"].split())[:80]
    return f"{where}: {why}" if where else why


def origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of a URL, the port made explicit where the scheme implies it."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port or DEFAULT_PORTS.get(scheme)
    except ValueError:  # a port that is not a number: matches nothing
        port = -1
    return scheme, (parts.hostname or "").lower(), port


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def may_carry_credentials(realm: str, base: str) -> bool:
    """Whether the token service a registry's Bearer challenge names may get the credentials
    given for the registry at `base`: on the registry's own origin; over https (Docker Hub's is
    another host); or on loopback when the registry itself is plain HTTP on loopback (a local
    rehearsal). Never in clear to another machine, and never downgraded from TLS."""
    if same_origin(realm, base):
        return True
    scheme, host, _ = origin(realm)
    if scheme == "https":
        return True
    base_scheme, base_host, _ = origin(base)
    return (
        scheme == base_scheme == "http" and host in LOOPBACK_HOSTS and base_host in LOOPBACK_HOSTS
    )


def same_origin(url: str, other: str) -> bool:
    """Whether two URLs have one origin (scheme, host, port): only then may a request to `url`
    carry the credentials given for `other`."""
    return origin(url) == origin(other)
