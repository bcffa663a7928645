"""Bundle format v2 on disk: the folder layout, its file names and the SHA256SUMS text.

bundles/<name>/<version>/<model-slug>-<fingerprint[:12]>/
    cache.safetensors  manifest.json  SHA256SUMS  [build-report.json]
"""

from __future__ import annotations

from pathlib import Path

CACHE_FILE = "cache.safetensors"
MANIFEST_FILE = "manifest.json"
SUMS_FILE = "SHA256SUMS"
REPORT_FILE = "build-report.json"  # measurements; informational, not checksummed (varies per run)
CHECKSUMMED = (CACHE_FILE, MANIFEST_FILE)
ALLOWED_FILES = frozenset({*CHECKSUMMED, SUMS_FILE, REPORT_FILE})
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
