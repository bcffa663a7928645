"""A bundle folder (format v2): its layout, file names, the SHA256SUMS text, and strict readers.

bundles/<name>/<version>/<model-slug>-<fingerprint[:12]>/
    cache.safetensors  manifest.json  SHA256SUMS  [build-report.json]  [manifest.json.minisig]

The readers (folder listing, SHA256SUMS, manifest.json) are used by the validator
(pipeline.format.validate) and by the build side to read old manifests. Each refuses with a
BundleError naming the file and the fix; none opens a special file.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pipeline.format.errors import BundleError
from pipeline.format.fingerprint import sha256_bytes
from pipeline.format.manifest import (
    FORMAT_VERSION,
    MAX_MANIFEST_BYTES,
    READ_VERSIONS,
    Manifest,
    ManifestKind,
)
from pipeline.format.names import LAYOUT_FOLDER  # noqa: F401  (re-exported: the layout's name)
from pipeline.format.regular_files import FileProblem, kind_of, read_regular

CACHE_FILE = "cache.safetensors"
MANIFEST_FILE = "manifest.json"
SUMS_FILE = "SHA256SUMS"
REPORT_FILE = "build-report.json"  # measurements; informational, not checksummed (varies per run)
# minisign signature of manifest.json's bytes (pipeline.format.bundle_signature); not in SHA256SUMS:
# signing adds it to a finished bundle without changing any other file
SIGNATURE_FILE = "manifest.json.minisig"
CHECKSUMMED = (CACHE_FILE, MANIFEST_FILE)
ALLOWED_FILES = frozenset({*CHECKSUMMED, SUMS_FILE, REPORT_FILE, SIGNATURE_FILE})
STAGING_DIR = ".staging"  # under the bundles root; never read as bundles
MAX_SUMS_BYTES = 4096
FINGERPRINT_CHARS = 12


def sums_text(digests: dict[str, str]) -> str:
    """`sha256sum -c` lines, one per checksummed file, in a fixed order."""
    return "".join(f"{digests[name]}  {name}\n" for name in CHECKSUMMED)


def model_folder(slug: str, fingerprint: str) -> str:
    """A bundle's model part: unique per model fingerprint, readable by its slug."""
    return f"{slug}-{fingerprint[:FINGERPRINT_CHARS]}"


def bundle_path(bundles_root: Path, name: str, version: int, slug: str, fingerprint: str) -> Path:
    """bundles/<name>/<version>/<slug>-<fingerprint prefix>."""
    return Path(bundles_root) / name / str(version) / model_folder(slug, fingerprint)


SUMS_LINE = re.compile(r"^([0-9a-f]{64}) [ *](\S+)\Z")


def refuse(bundle: Path, message: str, field: str | None = None) -> BundleError:
    return BundleError(str(bundle), message, field)


def check_folder(bundle: Path) -> None:
    """The folder holds exactly the bundle's files, each a regular file (no links, no FIFOs)."""
    try:
        st = os.stat(bundle)
    except OSError as exc:
        raise refuse(bundle, f"not a bundle folder ({exc.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise refuse(bundle, f"not a bundle folder (it is {kind_of(st.st_mode)})")
    present = {}
    for entry in os.scandir(bundle):
        if entry.name not in ALLOWED_FILES:
            allowed = ", ".join(sorted(ALLOWED_FILES))
            raise refuse(
                bundle,
                f"unexpected {entry.name!r} in the bundle folder (a bundle holds only {allowed}); "
                "remove it or re-copy the bundle",
                entry.name,
            )
        mode = entry.stat(follow_symlinks=False).st_mode
        if not stat.S_ISREG(mode):
            raise refuse(bundle, f"{entry.name} is {kind_of(mode)}, not a regular file", entry.name)
        present[entry.name] = mode
    for name in (SUMS_FILE, *CHECKSUMMED):
        if name not in present:
            raise refuse(bundle, f"{name} is missing; rebuild or re-copy the bundle", name)


def read_sums(bundle: Path) -> dict[str, str]:
    """SHA256SUMS as {file: hex}: exactly one `sha256sum` line per checksummed file."""
    try:
        text = read_regular(bundle / SUMS_FILE, MAX_SUMS_BYTES, follow=False).decode("ascii")
    except FileProblem as exc:
        raise refuse(bundle, f"{SUMS_FILE} {exc}", SUMS_FILE) from None
    except UnicodeDecodeError:
        raise refuse(
            bundle, f"{SUMS_FILE} is not ASCII text; re-copy the bundle", SUMS_FILE
        ) from None
    sums: dict[str, str] = {}
    for line in text.splitlines():
        match = SUMS_LINE.match(line)
        if not match or match[2] not in CHECKSUMMED or match[2] in sums:
            raise refuse(bundle, f"{SUMS_FILE} has a malformed line {line[:80]!r}", SUMS_FILE)
        sums[match[2]] = match[1]
    missing = [n for n in CHECKSUMMED if n not in sums]
    if missing:
        raise refuse(bundle, f"{SUMS_FILE} does not list {', '.join(missing)}", SUMS_FILE)
    return sums


def digest_mismatch(
    bundle: Path, name: str, expected: str, found: str, algorithm: str = "sha256"
) -> BundleError:
    return refuse(
        bundle,
        f"{name} {algorithm} mismatch (expected {expected[:12]}.., found {found[:12]}..); "
        "the file is corrupt or was edited: rebuild it or copy it again",
        name,
    )


def read_manifest(
    bundle: Path, expected_sha256: str | None, kind: ManifestKind | None = "prefix"
) -> Manifest:
    """manifest.json, its sha256 checked when given, parsed into the strict schema, of `kind`
    (None: either kind, for a reader that handles both)."""
    return parse_manifest(bundle, read_manifest_bytes(bundle, expected_sha256), kind)


def read_manifest_bytes(bundle: Path, expected_sha256: str | None) -> bytes:
    """manifest.json's bytes, read once, their sha256 checked when given (what a signature covers)."""
    try:
        data = read_regular(bundle / MANIFEST_FILE, MAX_MANIFEST_BYTES, follow=False)
    except FileProblem as exc:
        raise refuse(bundle, f"{MANIFEST_FILE} {exc}", MANIFEST_FILE) from None
    if expected_sha256 is not None and sha256_bytes(data) != expected_sha256:
        raise digest_mismatch(bundle, MANIFEST_FILE, expected_sha256, sha256_bytes(data))
    return data


def parse_manifest(bundle: Path, data: bytes, kind: ManifestKind | None = "prefix") -> Manifest:
    """manifest.json's bytes parsed into the strict schema, of `kind` (None: either); BundleError
    naming the field if not. Every reader states the kinds it uses: one refusal, never an
    attribute error on a field another kind leaves empty."""
    try:
        manifest = Manifest.model_validate_json(data)
    except ValidationError as exc:
        raise _manifest_error(bundle, exc, data) from None
    if (problem := repeated_key(data)) is not None:  # parsers disagree on which value counts
        raise refuse(bundle, f"{MANIFEST_FILE} {problem}; rebuild the bundle", MANIFEST_FILE)
    if kind is not None:
        check_kind(bundle, manifest, kind)
    return manifest


def check_kind(bundle: Path, manifest: Manifest, kind: ManifestKind) -> None:
    """A snapshot is never used as a prefix bundle, nor a bundle as a snapshot."""
    found = manifest.kind or "prefix"
    if found != kind:
        raise refuse(
            bundle,
            f"its manifest is of kind {found}, not {kind} (a {found} is never used as a {kind}); "
            "move it out of this folder",
            "kind",
        )


def repeated_key(data: bytes) -> str | None:
    """What is wrong when some object of a JSON document (parsed once already, so well formed)
    repeats a key, else None."""
    repeated: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in items]
        if len(set(keys)) != len(keys) and not repeated:
            repeated.append(next(k for i, k in enumerate(keys) if k in keys[:i]))
        return dict(items)

    try:
        json.loads(data, object_pairs_hook=pairs)
    except RecursionError:
        return "is nested too deep to check its keys"
    return f"has the key {repeated[0]!r} twice in one object" if repeated else None


def _format_refusal(version: object, data: bytes) -> str:
    """Why a format_version is not read, and what to do: a newer format names the release that
    built it (builder.pipeline), the version to upgrade this runtime to."""
    reads = ", ".join(map(str, READ_VERSIONS))
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        try:
            built_by = json.loads(data)["builder"]["pipeline"]
        except (ValueError, KeyError, TypeError, RecursionError):
            built_by = None
        release = (
            f"mlx-prefix-bundles {str(built_by)[:40]} or later"
            if isinstance(built_by, str)
            else "a newer mlx-prefix-bundles"
        )
        return (
            f"format_version {version} is newer than this runtime reads ({reads}); "
            f"upgrade the runtime to {release}"
        )
    return f"format_version {version!r} is not supported (this runtime reads {reads}); rebuild it with this version"


def _manifest_error(bundle: Path, exc: ValidationError, data: bytes) -> BundleError:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(top level)"
    if where == "format_version":
        return refuse(bundle, _format_refusal(err.get("input"), data), "format_version")
    return refuse(
        bundle, f"{MANIFEST_FILE} is invalid at {where}: {err['msg']}; rebuild the bundle", where
    )
