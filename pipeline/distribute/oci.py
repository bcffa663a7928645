"""A thin OCI distribution client over httpx: blobs, manifests and tags of one repository.

About ten endpoints of the distribution spec: blob HEAD, upload (POST then PUT) and cross-repo
mount, blob GET (digest and size checked while it streams), manifest PUT/GET by tag or digest, the
tag list, over one transport (oci_http: httpx). TLS verified by the system store or a CA bundle
file; plain HTTP when asked (--plain-http), or on loopback when the port answers in plain HTTP
(HTTPS is tried first, as Docker does; never with a CA bundle given). Credentials and the basic/bearer challenge live in oci_auth. Transport
errors, 429 and 5xx are retried with backoff; what still fails is one PipelineError line.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pipeline.distribute.artifact import MAX_MANIFEST_BYTES
from pipeline.distribute.meter import Meter
from pipeline.distribute.oci_auth import Challenge, auth_header, credentials
from pipeline.distribute.oci_http import (
    MAX_REDIRECTS,
    REDIRECTS,
    TLS_ANSWER,
    Body,
    client,
    httpx,
    paced,
    probe_plain,
    tls_failure,
)
from pipeline.distribute.oci_tags import list_tags
from pipeline.distribute.untrusted import read_capped, same_origin
from pipeline.format.errors import PipelineError

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
RETRIES = 4
TRANSFERS = 4  # blobs in flight at once: a registry spends a few requests on each blob
BACKOFF_S = 0.5
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
REPO_URL = re.compile(
    r"^oci://(?P<host>[A-Za-z0-9.-]+(?::[0-9]{1,5})?|\[[0-9a-fA-F:]+\](?::[0-9]{1,5})?)"
    r"/(?P<name>[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*)\Z"
)
MAX_SMALL_BODY = 64 << 10  # what is read of a body only its message needs (an error, a PUT's)
TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}\Z")
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}\Z")
SIZE = re.compile(r"^[0-9]{1,19}\Z")  # a Content-Length: ASCII digits only


@dataclass(frozen=True)
class RepoRef:
    """oci://HOST[:PORT]/NAMESPACE/NAME, parsed."""

    host: str
    name: str

    @property
    def url(self) -> str:
        return f"oci://{self.host}/{self.name}"

    @property
    def loopback(self) -> bool:
        return self.host.rsplit(":", 1)[0] in LOOPBACK or self.host.startswith("[::1]")


def in_parallel(fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
    """fn over items, TRANSFERS at a time, results in order; the first failure cancels what has
    not started and is raised once the running ones end."""
    with ThreadPoolExecutor(TRANSFERS) as pool:
        futures = [pool.submit(fn, x) for x in items]
        try:
            return [f.result() for f in futures]
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def is_oci(repo: str) -> bool:
    return repo.startswith("oci://")


def parse_repo(repo: str) -> RepoRef:
    m = REPO_URL.match(repo)
    if not m:
        raise PipelineError(
            f"--repo {repo!r} is not an OCI repository; pass it as oci://HOST[:PORT]/NAMESPACE/NAME "
            "(lower-case path components)"
        )
    return RepoRef(m["host"], m["name"])


class Registry:
    """One repository of one registry, with its credentials and the token they earned."""

    def __init__(self, ref: RepoRef, *, plain_http: bool = False, ca_bundle: str | None = None):
        self.ref = ref
        if plain_http and ca_bundle:
            raise PipelineError(
                "--plain-http and --ca-bundle contradict each other (a CA bundle verifies TLS); "
                "pass one"
            )
        self.plain_asked, self.ca_bundle = plain_http, ca_bundle
        self._base: str | None = None  # decided at the first request (loopback: probed)
        self._client: Any = None
        self.creds = credentials(ref.host)
        self.header: dict[str, str] = {}
        self.sleep: Callable[[float], None] = time.sleep
        self.meter = Meter()  # seconds hashing and writing what streams in (the benchmark)

    @property
    def base(self) -> str:
        """http(s)://HOST/v2/NAME: HTTPS unless --plain-http; on loopback, plain HTTP when the
        port answers in it (a local rehearsal), never when a CA bundle was given."""
        if self._base is None:
            origin = f"https://{self.ref.host}"
            if self.plain_asked:
                origin = f"http://{self.ref.host}"
            elif self.ref.loopback and probe_plain(origin):
                if self.ca_bundle:
                    raise PipelineError(
                        f"registry {self.ref.host}: it answers in plain HTTP, not TLS, but "
                        f"--ca-bundle {self.ca_bundle} was given; serve the registry over TLS, "
                        "or drop --ca-bundle"
                    )
                origin = f"http://{self.ref.host}"
            self._base = f"{origin}/v2/{self.ref.name}"
        return self._base

    @property
    def client(self) -> Any:
        if self._client is None:
            plain = self.base.startswith("http://")  # plain HTTP builds no TLS context
            self._client = client(False if plain else self.ca_bundle or True)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # --- requests: retries, the auth challenge, one line on failure ----------------------------

    def request(self, method: str, url: str, doing: str, ok: tuple[int, ...], **kw: Any) -> Any:
        """One request (retried, authorized); a status outside `ok` is a PipelineError."""
        r = self._send(method, url, doing, **kw)
        if r.status_code in ok:
            return r
        raise self.failed(doing, r)

    def _send(self, method: str, url: str, doing: str, stream: bool = False, **kw: Any) -> Any:
        """The response (its body unread and open when `stream`: the caller closes it)."""
        extra = kw.pop("headers", None) or {}
        last = ""
        for attempt in range(RETRIES):
            if attempt:
                self.sleep(BACKOFF_S * 2 ** (attempt - 1))
            try:
                r = self._once(method, url, extra, stream, kw)
                mine = same_origin(url, self.base)  # another origin's challenge is not answered
                if r.status_code == 401 and mine and self._authorize(r, doing):
                    r.close()
                    r = self._once(method, url, extra, stream, kw)
            except httpx.RequestError as exc:
                if (why := tls_failure(exc)) is not None:  # no retry changes either
                    raise self.tls_error(doing, why, exc) from None
                if "Content-Length" in str(exc):  # h11 refuses it before we see it: no retry
                    raise PipelineError(
                        f"registry {self.ref.host}: {doing}: it answered with a Content-Length "
                        f"that is not a size ({exc}); check the registry"
                    ) from None
                last = f"{exc.__class__.__name__}: {' '.join(str(exc).split())[:120]}"
                continue
            if r.status_code != 429 and r.status_code < 500:
                return r
            small_body(r)
            r.close()
            last = f"HTTP {r.status_code}{_error_detail(r)}"
        raise PipelineError(
            f"registry {self.ref.host}: {doing} failed after {RETRIES} tries ({last}); check that "
            "the registry is up and reachable, then retry"
        )

    def _once(self, method: str, url: str, extra: dict, stream: bool, kw: dict) -> Any:
        # a URL the registry named on another origin (an upload Location) gets no credentials
        headers = {**(self.header if same_origin(url, self.base) else {}), **extra}
        content = kw.get("content")
        if content is not None and not isinstance(content, bytes):  # buffers, sent in order
            headers["content-length"] = str(sum(len(b) for b in content))
            kw = {**kw, "content": list(content)}
        request = self.client.build_request(method, url, headers=headers, **kw)
        r = self.client.send(request, stream=True)
        if r.status_code >= 400 or not stream:
            small_body(r)  # for the message: no more than MAX_SMALL_BODY is read
        if not stream:
            r.close()
        return r

    def _authorize(self, r: Any, doing: str) -> bool:
        """Answer a 401's challenge once per credential state; False when nothing changes."""
        challenge = Challenge.parse(r.headers.get("www-authenticate", ""))
        header = auth_header(self.client, challenge, self.creds, self.ref, doing, self.base)
        if header is None or header == self.header:
            return False
        self.header = header
        return True

    def tls_error(self, doing: str, why: str, exc: BaseException) -> PipelineError:
        if why == "plain":
            return self.wrong_scheme(doing, "answers in plain HTTP, not TLS")
        given = f"--ca-bundle {self.ca_bundle}" if self.ca_bundle else "the system's CAs"
        return PipelineError(
            f"registry {self.ref.host}: {doing}: its TLS certificate is not trusted by {given} "
            f"({' '.join(str(exc).split())[:120]}); pass --ca-bundle FILE with the CA that "
            "signed it"
        )

    def _speaks_tls(self, r: Any) -> bool:
        """Whether a 400 over plain HTTP came from a TLS port (as Go's servers answer it; a HEAD
        has no body to say so: /v2/ is asked)."""
        if not self.base.startswith("http://"):
            return False
        if TLS_ANSWER in small_body(r):
            return True
        try:
            with self.client.stream("GET", self.base.split("/v2/", 1)[0] + "/v2/") as probe:
                return probe.status_code == 400 and TLS_ANSWER in small_body(probe)
        except httpx.RequestError:
            return False

    def wrong_scheme(self, doing: str, what: str) -> PipelineError:
        fix = "pass --plain-http" if what.endswith("not TLS") else "drop --plain-http"
        if not self.ref.loopback and fix == "pass --plain-http":
            fix += " (and only where the network between is trusted)"
        return PipelineError(f"registry {self.ref.host}: {doing}: its port {what}; {fix}")

    def failed(self, doing: str, r: Any) -> PipelineError:
        where = f"registry {self.ref.host}: {doing}"
        if r.status_code == 400 and self._speaks_tls(r):
            return self.wrong_scheme(doing, "speaks TLS (HTTPS), not plain HTTP")
        if r.status_code in (401, 403):
            who = f"as {self.creds.username!r}" if self.creds else "without credentials"
            return PipelineError(
                f"{where}: not authorized (HTTP {r.status_code}, {who}); log in with 'docker "
                "login' (read from ~/.docker/config.json) or set PREFIX_BUNDLES_REGISTRY_USER "
                "and PREFIX_BUNDLES_REGISTRY_PASSWORD"
            )
        detail = _error_detail(r)
        return PipelineError(f"{where}: HTTP {r.status_code}{detail}")

    # --- blobs -------------------------------------------------------------------------------------

    def has_blob(self, digest: str) -> int | None:
        """The blob's size when the repository has it, else None."""
        r = self.request(
            "HEAD", f"{self.base}/blobs/{digest}", f"checking blob {digest[:19]}", (200, 404)
        )
        if r.status_code != 200:
            return None
        length = r.headers.get("content-length", "0")  # none given: there, size unsaid
        if not SIZE.match(length):
            raise PipelineError(
                f"registry {self.ref.host}: checking blob {digest[:19]}: it answered with "
                f"Content-Length {' '.join(length.split())[:40]!r}, not a size; check the registry"
            )
        return int(length)

    def mount(self, digest: str, source: str) -> bool:
        """Cross-repository mount of a blob from `source` (a repository name on this registry)."""
        url = f"{self.base}/blobs/uploads/"
        r = self.request(
            "POST",
            url,
            f"mounting {digest[:19]}",
            (201, 202),
            params={"mount": digest, "from": source},
        )
        if r.status_code == 202:  # not mounted: an upload session was opened instead; drop it
            self._send("DELETE", self._location(r), "cancelling an upload")
        return r.status_code == 201

    def upload(self, digest: str, data: Body) -> None:
        """A monolithic upload: POST opens the session, PUT sends the bytes and the digest
        (`data`: bytes, or buffers sent one after another)."""
        size = len(data) if isinstance(data, bytes) else sum(len(b) for b in data)
        doing = f"uploading blob {digest[:19]} ({size:,} bytes)"
        r = self.request("POST", f"{self.base}/blobs/uploads/", doing, (202,))
        location = self._location(r)
        sep = "&" if "?" in location else "?"
        self.request(
            "PUT",
            f"{location}{sep}digest={digest}",
            doing,
            (201,),
            content=data,
            headers={"content-type": "application/octet-stream"},
        )

    def _location(self, r: Any) -> str:
        location = r.headers.get("location")
        if not location:
            raise PipelineError(
                f"registry {self.ref.host}: it opened an upload (HTTP {r.status_code}) with no "
                "Location to send it to; check that it is an OCI registry"
            )
        return str(r.url.join(location))

    def stream_blob(self, digest: str, size: int, sink: Callable[[bytes], None]) -> None:
        """GET a blob into sink, checking its size and sha256 as it streams (nothing is kept: each
        piece the sink gets may be a view of a buffer reused for the next).

        A broken connection is retried from the byte where it broke (a Range request): no byte
        reaches the sink twice and every byte that does is hashed."""
        doing = f"downloading blob {digest[:19]} ({size:,} bytes)"
        h, n = hashlib.sha256(), 0
        for attempt in range(RETRIES):
            if attempt:
                self.sleep(BACKOFF_S * 2 ** (attempt - 1))
            try:
                for chunk in self._blob_chunks(digest, size, doing, n):
                    if n + len(chunk) > size:
                        n += len(chunk)
                        break
                    with self.meter.phase("hash"):
                        h.update(chunk)
                    with self.meter.phase("write"):
                        sink(chunk)
                    n += len(chunk)
                break
            except httpx.RequestError:
                if attempt == RETRIES - 1:
                    raise PipelineError(
                        f"registry {self.ref.host}: {doing} failed after {RETRIES} tries (the "
                        "connection broke); pull again to resume: nothing was published"
                    ) from None
        got = "sha256:" + h.hexdigest()
        if n != size or got != digest:
            raise PipelineError(
                f"registry {self.ref.host}: blob {digest} of {self.ref.name} is not what its "
                f"manifest lists (got {n:,} bytes, {got[:19]}.., expected {size:,} bytes): the "
                "registry's copy is damaged or was altered; push the bundle again. Nothing was "
                "published"
            )

    def _blob_chunks(
        self, digest: str, size: int, doing: str, start: int = 0, answered: bool = False
    ) -> Iterator[Any]:
        """The blob's bytes from `start` on (a Range request when start > 0), in pieces that
        may be views of one buffer: each is valid until the next is asked for. A 401 is answered
        once, and only from the registry's own origin (not a store it redirected to)."""
        headers = {**self.header, "range": f"bytes={start}-"} if start else self.header
        with self._open_blob(f"{self.base}/blobs/{digest}", headers) as r:
            mine = same_origin(str(r.url), self.base)
            if r.status_code == 401 and mine and not answered and self._authorize(r, doing):
                yield from self._blob_chunks(digest, size, doing, start, answered=True)
                return
            if r.status_code == 404:
                raise PipelineError(
                    f"registry {self.ref.host}: blob {digest} of {self.ref.name} is missing "
                    f"(HTTP 404{_error_detail(r)}): the artifact lists it, the "
                    "registry lost it (deleted, or garbage-collected while still listed); push "
                    "the bundle again. Nothing was published"
                )
            if r.status_code not in (200, 206):
                raise self.failed(doing, r)
            skip = start if r.status_code == 200 else 0  # the server ignored the Range
            # paced by what is expected, not by the length the server claims
            for chunk in paced(r.iter_bytes(), size):
                if skip:
                    cut, skip = min(skip, len(chunk)), skip - min(skip, len(chunk))
                    chunk = chunk[cut:]
                if chunk:
                    yield chunk

    @contextmanager
    def _open_blob(self, url: str, headers: dict[str, str]) -> Iterator[Any]:
        """A blob GET's response, its redirects followed here (httpx would read each redirect's
        body whole); credentials go to the same origin only."""
        for _ in range(MAX_REDIRECTS + 1):  # followed here: httpx reads each redirect's body whole
            with self.client.stream("GET", url, headers=headers) as r:
                target = r.headers.get("location")
                if r.status_code in REDIRECTS and target:
                    small_body(r)
                    target = str(r.url.join(target))
                    if not same_origin(target, url):
                        headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
                    url = target
                    continue
                if r.status_code >= 400:
                    small_body(r)
                yield r
                return
        raise httpx.TooManyRedirects(f"more than {MAX_REDIRECTS} redirects")

    def get_blob(self, digest: str, size: int) -> bytes:
        parts: list[bytes] = []
        self.stream_blob(digest, size, lambda chunk: parts.append(bytes(chunk)))
        return b"".join(parts)

    # --- manifests and tags -------------------------------------------------------------------

    def put_manifest(self, reference: str, body: bytes, media_type: str = OCI_MANIFEST) -> str:
        """PUT a manifest under a tag (or its digest); returns the digest the registry gives."""
        if len(body) > MAX_MANIFEST_BYTES:  # push_oci checks this before any upload
            raise PipelineError(
                f"registry {self.ref.host}: the artifact manifest of {reference} is {len(body):,} "
                f"bytes, over the registry limit of {MAX_MANIFEST_BYTES:,}; nothing was tagged"
            )
        r = self.request(
            "PUT",
            f"{self.base}/manifests/{reference}",
            f"tagging {reference}",
            (201,),
            content=body,
            headers={"content-type": media_type},
        )
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        given = r.headers.get("docker-content-digest", digest)
        if given != digest:
            raise PipelineError(
                f"registry {self.ref.host}: stored the manifest of {reference} as {given}, not "
                f"{digest}; check the registry"
            )
        return digest

    def get_manifest(self, reference: str) -> tuple[bytes, str]:
        """(body, digest) of a manifest by tag or digest; a digest reference is checked, and no
        more than the registry's own limit is read."""
        doing = f"reading manifest {reference}"
        url = f"{self.base}/manifests/{reference}"
        r = self._send("GET", url, doing, stream=True, headers={"accept": OCI_MANIFEST})
        try:
            if r.status_code != 200:
                raise self.failed(doing, r)
            body, over = self._capped(r, MAX_MANIFEST_BYTES, doing)
        finally:
            r.close()
        where = f"registry {self.ref.host}: manifest {reference} of {self.ref.name}"
        if over:
            raise PipelineError(
                f"{where} is over {MAX_MANIFEST_BYTES:,} bytes, the most a registry accepts (the "
                "rest was not read): not an artifact this tool pushed; push the bundle again. "
                "Nothing was published"
            )
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        claimed = reference if DIGEST.match(reference) else r.headers.get("docker-content-digest")
        if claimed and claimed != digest:
            raise PipelineError(
                f"{where} does not match its digest (expected {claimed}, got {digest}); the "
                "registry's copy is damaged or was altered: push the bundle again. Nothing was "
                "published"
            )
        return body, digest

    def _capped(self, r: Any, cap: int, doing: str) -> tuple[bytes, bool]:
        """(the body, whether it goes past cap): reading stops one chunk past the cap."""
        try:
            body = read_capped(pieces(r, cap + 1), cap)
        except httpx.RequestError as exc:
            raise PipelineError(
                f"registry {self.ref.host}: {doing} failed (the connection broke: "
                f"{exc.__class__.__name__}); retry: nothing was published"
            ) from None
        return (b"", True) if len(body) > cap else (body, False)

    def tags(self) -> list[str]:
        """Every tag of the repository (oci_tags: Link pages on this origin, each once); [] for
        a new repository."""
        return list_tags(self)


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


def _error_detail(r: Any) -> str:
    try:
        errors = json.loads(small_body(r)).get("errors") or []
        text = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors)
    except Exception:
        text = ""
    return f" ({' '.join(text.split())[:160]})" if text else ""
