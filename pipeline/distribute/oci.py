"""A thin OCI distribution client over httpx: one repository of one registry.

About ten endpoints of the distribution spec: the blob calls (oci_blobs: HEAD, upload, mount,
GET), manifest PUT/GET by tag or digest and the tag list (oci_tags), over one transport
(oci_http: httpx). TLS verified by the system store or a CA bundle file; plain HTTP when asked
(--plain-http), or on loopback when the port answers in plain HTTP (HTTPS is tried first, as
Docker does; never with a CA bundle given). Credentials and the basic/bearer challenge live in
oci_auth. Transport errors, 429 and 5xx are retried with backoff; what still fails is one
PipelineError line.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from typing import Any

from pipeline.distribute.artifact import MAX_MANIFEST_BYTES
from pipeline.distribute.meter import Meter
from pipeline.distribute.oci_auth import Challenge, auth_header, credentials
from pipeline.distribute.oci_blobs import BlobCalls
from pipeline.distribute.oci_http import (
    RETRIES,
    TLS_ANSWER,
    client,
    error_detail,
    httpx,
    pieces,
    probe_plain,
    small_body,
    tls_failure,
)
from pipeline.distribute.oci_ref import TRANSFERS, RepoRef, in_parallel, is_oci, parse_repo
from pipeline.distribute.oci_tags import list_tags
from pipeline.distribute.untrusted import read_capped, same_origin
from pipeline.format.errors import PipelineError

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
BACKOFF_S = 0.5
TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}\Z")
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}\Z")


class Registry(BlobCalls):
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

    def pause(self, attempt: int) -> None:
        """The wait before a retry: BACKOFF_S, doubled each time."""
        self.sleep(BACKOFF_S * 2 ** (attempt - 1))

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
                self.pause(attempt)
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
            last = f"HTTP {r.status_code}{error_detail(r)}"
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
        detail = error_detail(r)
        return PipelineError(f"{where}: HTTP {r.status_code}{detail}")

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


# the reference and the pool live in oci_ref; importers of this module's client find them here
__all__ = ["TRANSFERS", "Registry", "RepoRef", "in_parallel", "is_oci", "parse_repo"]
