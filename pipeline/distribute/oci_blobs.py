"""The blob calls of the OCI client (a mixin of oci.Registry, which sends the requests): HEAD,
upload (POST then PUT), cross-repository mount, and GET, its digest and size checked while it
streams, resumed from the byte where a connection broke, its redirects followed here with
credentials for the same origin only."""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pipeline.distribute.oci_http import (
    MAX_REDIRECTS,
    REDIRECTS,
    RETRIES,
    Body,
    error_detail,
    httpx,
    paced,
    small_body,
)
from pipeline.distribute.untrusted import same_origin
from pipeline.format.errors import PipelineError

SIZE = re.compile(r"^[0-9]{1,19}\Z")  # a Content-Length: ASCII digits only


class BlobCalls:
    """Blobs of one repository; needs Registry's request, _send, _authorize, failed, pause and
    its ref, base, header, client and meter."""

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
        h, n, clock, spent = hashlib.sha256(), 0, time.perf_counter, [0.0, 0.0]
        for attempt in range(RETRIES):
            if attempt:
                self.pause(attempt)
            try:
                for chunk in self._blob_chunks(digest, size, doing, n):
                    if n + len(chunk) > size:
                        n += len(chunk)
                        break
                    # timed here, summed once per blob: a TLS body comes in 16 KiB records, and
                    # a locked meter phase per piece cost ~0.27 s of CPU per GB
                    t0 = clock()
                    h.update(chunk)
                    t1 = clock()
                    sink(chunk)
                    spent[0], spent[1] = spent[0] + t1 - t0, spent[1] + clock() - t1
                    n += len(chunk)
                break
            except httpx.RequestError:
                if attempt == RETRIES - 1:
                    raise PipelineError(
                        f"registry {self.ref.host}: {doing} failed after {RETRIES} tries (the "
                        "connection broke); pull again to resume: nothing was published"
                    ) from None
        self.meter.add("hash", spent[0])
        self.meter.add("write", spent[1])
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
                    f"(HTTP 404{error_detail(r)}): the artifact lists it, the "
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
