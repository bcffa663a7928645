"""Bundle format v1: write/read pair for cache.safetensors + manifest.json + SHA256SUMS.

Runtime-safe: imports mlx and mlx_lm's cache module only, never the build path.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pipeline.errors import BundleError
from pipeline.fingerprint import sha256_bytes, sha256_file
from pipeline.manifest import FORMAT_VERSION, Manifest, manifest_bytes

CACHE_FILE = "cache.safetensors"
MANIFEST_FILE = "manifest.json"
SUMS_FILE = "SHA256SUMS"
REPORT_FILE = "build-report.json"  # measurements; informational, not checksummed (varies per run)
CHECKSUMMED = (CACHE_FILE, MANIFEST_FILE)
STAGING_DIR = ".staging"


def sums_text(digests: dict[str, str]) -> str:
    """`sha256sum -c` lines, one per file, in a fixed order."""
    return "".join(f"{digests[name]}  {name}\n" for name in CHECKSUMMED)


def parse_sums(bundle: Path) -> dict[str, str]:
    """Read SHA256SUMS into {file: hex}; raise BundleError when missing or malformed."""
    path = bundle / SUMS_FILE
    if not path.is_file():
        raise BundleError(
            str(bundle), f"{SUMS_FILE} is missing; rebuild or re-copy the bundle", SUMS_FILE
        )
    sums: dict[str, str] = {}
    for line in path.read_text().splitlines():
        digest, _, name = line.partition("  ")
        name = name.lstrip("*")
        if len(digest) != 64 or name not in CHECKSUMMED:
            raise BundleError(str(bundle), f"{SUMS_FILE} has a malformed line {line!r}", SUMS_FILE)
        sums[name] = digest
    missing = [n for n in CHECKSUMMED if n not in sums]
    if missing:
        raise BundleError(str(bundle), f"{SUMS_FILE} does not list {', '.join(missing)}", SUMS_FILE)
    return sums


def check_digest(bundle: Path, name: str, expected: str, found: str) -> None:
    """Raise a BundleError naming the file when its sha256 differs from SHA256SUMS."""
    if expected != found:
        raise BundleError(
            str(bundle),
            f"{name} sha256 mismatch (expected {expected[:12]}.., found {found[:12]}..); "
            "the file is corrupt or was edited: rebuild it or copy it again",
            name,
        )


def read_manifest(bundle: Path, sums: dict[str, str] | None = None) -> Manifest:
    """Read and validate manifest.json; when sums are given, check its sha256 first."""
    path = bundle / MANIFEST_FILE
    if not path.is_file():
        raise BundleError(
            str(bundle), f"{MANIFEST_FILE} is missing; rebuild the bundle", MANIFEST_FILE
        )
    data = path.read_bytes()
    if sums is not None:
        check_digest(bundle, MANIFEST_FILE, sums[MANIFEST_FILE], sha256_bytes(data))
    try:
        raw = json.loads(data)
        if raw.get("format_version") != FORMAT_VERSION:
            raise BundleError(
                str(bundle),
                f"format_version {raw.get('format_version')!r} is not supported "
                f"(this loader reads {FORMAT_VERSION}); rebuild with this version",
                "format_version",
            )
        return Manifest.model_validate(raw)
    except (ValueError, ValidationError) as exc:
        raise BundleError(
            str(bundle), f"{MANIFEST_FILE} is invalid ({exc.__class__.__name__})", MANIFEST_FILE
        ) from None


def verify_files(bundle: Path) -> Manifest:
    """Check SHA256SUMS against both files (full read) and return the manifest."""
    bundle = Path(bundle)
    if not bundle.is_dir():
        raise BundleError(str(bundle), "not a bundle folder (does not exist)")
    sums = parse_sums(bundle)
    manifest = read_manifest(bundle, sums)
    cache = bundle / CACHE_FILE
    if not cache.is_file():
        raise BundleError(str(bundle), f"{CACHE_FILE} is missing; rebuild the bundle", CACHE_FILE)
    check_digest(bundle, CACHE_FILE, sums[CACHE_FILE], sha256_file(cache))
    return manifest


def write_bundle(
    dest: Path,
    cache: list[Any],
    tokens: list[int],
    finish: Callable[[Path], Manifest],
    report: dict[str, Any],
    metadata: dict[str, str] | None = None,
) -> Manifest:
    """Write the bundle into a staging folder, then rename it into place (complete or absent).

    `finish` receives the staging folder once cache.safetensors is written (so checks can read
    the file as it will ship) and returns the manifest; raising there ships nothing.
    `metadata` (strings) is stored in cache.safetensors beside the token ids.
    """
    from mlx_lm.models.cache import save_prompt_cache

    dest = Path(dest)
    staging_root = _staging_root(dest)
    staging_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{dest.name}.{os.getpid()}.", dir=staging_root))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; deployed bundles must be readable
    try:
        user = {**(metadata or {}), "token_ids": json.dumps(tokens, separators=(",", ":"))}
        save_prompt_cache(str(tmp / CACHE_FILE), cache, user)
        manifest = finish(tmp)
        (tmp / MANIFEST_FILE).write_bytes(manifest_bytes(manifest))
        digests = {name: sha256_file(tmp / name) for name in CHECKSUMMED}
        (tmp / SUMS_FILE).write_text(sums_text(digests))
        (tmp / REPORT_FILE).write_text(json.dumps(report, sort_keys=True, indent=2) + "\n")
        _fsync_dir(tmp)
        _swap_into_place(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _staging_root(dest: Path) -> Path:
    # bundles/<name>/<version>/<slug> -> bundles/.staging, so readers never see partial folders
    return dest.parent.parent.parent / STAGING_DIR


def _fsync_dir(folder: Path) -> None:
    for path in folder.iterdir():
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())


def _swap_into_place(tmp: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists():
        old = tmp.with_name(tmp.name + ".old")
        os.rename(dest, old)
        os.rename(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, dest)


def clean_staging(bundles_root: Path) -> list[Path]:
    """Remove staging leftovers of killed builds (folders whose builder process is gone)."""
    removed = []
    for tmp in sorted((Path(bundles_root) / STAGING_DIR).glob("*.*.*")):
        pid = tmp.name.split(".")[-2]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _allowed_cache_classes() -> dict[str, type]:
    from mlx_lm.models import cache as cache_module

    names = (
        "KVCache",
        "QuantizedKVCache",
        "RotatingKVCache",
        "ArraysCache",
        "ChunkedKVCache",
        "ConcatenateKVCache",
    )
    return {n: getattr(cache_module, n) for n in names if hasattr(cache_module, n)}


def load_cache(bundle: Path, expected_sha256: str) -> tuple[list[Any], list[int]]:
    """Load cache.safetensors in one pass, checking its sha256 on the bytes as they are read.

    A file this machine already hashed in full, unchanged since by path, size, mtime and inode,
    is trusted without re-hashing (as the weights fingerprint is); `verify` always hashes.
    """
    from pipeline.fingerprint import memo_lookup, memo_store, stat_key
    from pipeline.verified_read import FormatError, read_verified

    path = Path(bundle) / CACHE_FILE
    if not path.is_file():
        raise BundleError(str(bundle), f"{CACHE_FILE} is missing; rebuild the bundle", CACHE_FILE)
    key = stat_key(path)
    known = memo_lookup(key) == expected_sha256
    try:
        arrays, metadata, found = read_verified(path, hash_bytes=not known)
    except (FormatError, OSError) as exc:
        raise BundleError(
            str(bundle), f"{CACHE_FILE} is not a readable safetensors file ({exc})", CACHE_FILE
        ) from None
    if not known:
        check_digest(Path(bundle), CACHE_FILE, expected_sha256, found)
        memo_store(key, found)
    return _rebuild(Path(bundle), arrays, metadata)


def _rebuild(bundle: Path, arrays: dict, metadata: dict[str, str]) -> tuple[list[Any], list[int]]:
    """Rebuild cache objects from mlx_lm's save_prompt_cache layout, classes from an allow-list."""
    from mlx.utils import tree_unflatten

    try:
        user, classes, scalars = tree_unflatten(list(metadata.items()))
        tokens = json.loads(user["token_ids"])
        for pos, kind in scalars[1:]:
            arrays[pos] = _decode_scalar(arrays[pos], kind)
        states = tree_unflatten(list(arrays.items()))
    except (KeyError, ValueError, TypeError) as exc:
        raise BundleError(
            str(bundle), f"{CACHE_FILE} metadata is not a prompt-cache layout ({exc})", CACHE_FILE
        ) from None
    allowed = _allowed_cache_classes()
    unknown = sorted(set(classes) - set(allowed))
    if unknown:
        raise BundleError(
            str(bundle),
            f"cache classes {unknown} are not supported by this loader (allowed: {sorted(allowed)})",
            "cache.classes",
        )
    if len(classes) != len(states):
        raise BundleError(
            str(bundle),
            f"{CACHE_FILE} lists {len(classes)} cache classes for {len(states)} layers",
            CACHE_FILE,
        )
    return [allowed[c].from_state(s) for c, s in zip(classes, states, strict=True)], tokens


def _decode_scalar(array: Any, kind: str) -> Any:
    if kind == "scalar":
        return array.item()
    if kind == "string":
        return "".join(chr(i) for i in array.tolist())
    if kind == "none":
        return None
    raise ValueError(f"unknown scalar kind {kind!r}")
