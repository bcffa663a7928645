"""An OCI repository reference (oci://HOST[:PORT]/NAMESPACE/NAME) and how many of its blobs
move at once."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pipeline.format.errors import PipelineError

TRANSFERS = 4  # blobs in flight at once: a registry spends a few requests on each blob
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
REPO_URL = re.compile(
    r"^oci://(?P<host>[A-Za-z0-9.-]+(?::[0-9]{1,5})?|\[[0-9a-fA-F:]+\](?::[0-9]{1,5})?)"
    r"/(?P<name>[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*)\Z"
)


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
