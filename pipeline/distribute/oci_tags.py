"""A repository's tag list, read as untrusted input: each page capped and validated, the Link
pages followed only on the registry's own origin, each page once, and at most MAX_PAGES.

A registry (or what answers in its place: a login page, a proxy) that gives anything else is one
PipelineError line; credentials never go to another origin, since no request is sent there.
"""

from __future__ import annotations

import re
from typing import Annotated, Any
from urllib.parse import urljoin

from pydantic import BaseModel, ConfigDict, Field

from pipeline.distribute.artifact import MAX_MANIFEST_BYTES
from pipeline.distribute.untrusted import Unfit, parse_as, same_origin
from pipeline.format.errors import PipelineError

MAX_PAGES = 1000  # of up to 1,000 tags each (`n=1000`)
MAX_PAGE_BYTES = MAX_MANIFEST_BYTES
# all pages together (~400,000 bundle tags): a page's tags take ~8x its bytes in memory
MAX_LIST_BYTES = 16 << 20
NEXT = re.compile(r'<([^>]+)>;\s*rel="next"')


class TagList(BaseModel):
    """One page: {"name": ..., "tags": [...]} (tags null for none)."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    tags: list[Annotated[str, Field(max_length=128)]] | None


def list_tags(registry: Any) -> list[str]:
    """Every tag of the registry's repository, sorted; [] when the registry has no such repo."""
    url, found, seen, read = f"{registry.base}/tags/list?n=1000", set(), set(), 0
    where = f"registry {registry.ref.host}: the tag list of {registry.ref.name}"
    while url:
        if url in seen or len(seen) == MAX_PAGES:
            why = "back to a page already read" if url in seen else f"past {MAX_PAGES:,} pages"
            raise PipelineError(
                f"{where}: its Link header goes on {why}; check the registry: nothing was published"
            )
        seen.add(url)
        page = _page(registry, url, where)
        if page is None:
            return []
        tags, link, size = page
        read += size
        if read > MAX_LIST_BYTES:
            raise PipelineError(
                f"{where} is over {MAX_LIST_BYTES:,} bytes across its first {len(seen):,} pages; "
                "prune the repository's old tags (docs/deploy.md) or pull from a repository "
                "of its own: nothing was published"
            )
        found.update(tags)  # a tag on two pages (added while paging) counts once
        nxt = NEXT.match(link)
        url = urljoin(url, nxt.group(1)) if nxt else ""
        if url and not same_origin(url, registry.base):
            raise PipelineError(
                f"{where}: its Link header sends the next page to another origin "
                f"({' '.join(url.split())[:80]}); no request was sent there: nothing was published"
            )
    return sorted(found)


def _page(registry: Any, url: str, where: str) -> tuple[list[str], str, int] | None:
    """(one page's tags, its Link header, its size); None for a repository the registry lacks
    (404)."""
    doing = "listing tags"
    r = registry._send("GET", url, doing, stream=True)
    try:
        if r.status_code not in (200, 404):
            raise registry.failed(doing, r)
        body, over = registry._capped(r, MAX_PAGE_BYTES, doing)
    finally:
        r.close()
    if r.status_code == 404:
        return None
    try:
        if over:
            raise Unfit(f"over {MAX_PAGE_BYTES:,} bytes")
        tags = parse_as(TagList, body, MAX_PAGE_BYTES).tags
    except Unfit as exc:
        raise PipelineError(
            f"{where} is not a tag list ({exc}); check that {registry.ref.host} is an OCI "
            "registry (not a login page or a proxy): nothing was published"
        ) from None
    return tags or [], r.headers.get("link", ""), len(body)
