"""Incremental builds: start the prefill from a bundle that already holds the new tokens' prefix.

The result must be byte-identical to a build from token 0, so a parent is used only where its
stored state IS the state a full build has at a chunk boundary:
- same weights, same MLX, mlx-lm and device (the same kernels), same prefill chunk size;
- full-precision KVCache layers only (trimmable; no quantized, rotating or recurrent state),
  stored in the dtype this build prefills in (the builder casts to the serving dtype at the end,
  so a bfloat16 bundle prefilled in float32 does not hold the float32 state);
- reuse stops at the last multiple of the chunk size at or below the shared token prefix, so the
  remaining chunks are exactly the full build's chunks.
The parent passes the one validator in full (both digests) before any of its bytes is used: a
child built on a tampered parent would carry valid pins over wrong data.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.format.bundle_folder import (
    CACHE_FILE,
    MANIFEST_FILE,
    check_folder,
    read_manifest,
    read_sums,
)
from pipeline.format.cache_codec import detect_layout, user_metadata
from pipeline.format.errors import BuildError, BundleError
from pipeline.format.fingerprint import ModelIdentity
from pipeline.format.manifest import DEFAULT_LAYOUT, BuilderInfo, Manifest, ParentInfo
from pipeline.format.safetensors_read import FormatError, read_header
from pipeline.format.validate import validate
from pipeline.runtime.mount import find_bundles


@dataclass(frozen=True)
class Wanted:
    """What this build needs of a parent."""

    tokens: list[int]
    identity: ModelIdentity
    builder: BuilderInfo
    compute_dtype: str  # the dtype the prefill holds its cache in
    step: int  # prefill chunk size


@dataclass(frozen=True)
class Resume:
    """A prefill's starting point: the parent's cache up to `done` tokens, and its record."""

    cache: list[Any]
    done: int
    parent: ParentInfo
    path: Path


def find_parent(
    bundles_root: Path, wanted: Wanted, exclude: Path, explicit: Path | None = None
) -> tuple[Resume | None, str]:
    """The usable parent reusing the most tokens (explicit: that one, else BuildError), and a
    line saying what was reused or why nothing was."""
    if explicit is not None:
        manifest, reason = examine(explicit, wanted)
        resume = None if manifest is None else _load(explicit, manifest, wanted)
        if resume is None:
            raise BuildError(
                f"--parent {explicit}: cannot be reused ({reason or 'refused by the validator'}); "
                "pass another bundle or drop --parent to build from token 0"
            )
        return resume, _reused_line(resume)
    try:
        found, _ = find_bundles(bundles_root)
    except BundleError:
        return None, "no earlier bundles to start from"
    candidates = []
    for path in found:
        manifest = None if path.resolve() == exclude.resolve() else examine(path, wanted)[0]
        if manifest is not None:
            reused = reusable_tokens(_token_ids(path), wanted)
            candidates.append((reused, str(path), path, manifest))
    for reused, _, path, manifest in sorted(candidates, key=lambda c: (-c[0], c[1])):
        if reused == 0:
            break
        resume = _load(path, manifest, wanted)
        if resume is not None:
            return resume, _reused_line(resume)
    return None, "no earlier bundle shares a whole prefill chunk with these tokens"


def reusable_tokens(parent_tokens: list[int], wanted: Wanted) -> int:
    """Tokens a parent can give: its common prefix with the new ids, down to a chunk boundary."""
    shared = 0
    for a, b in zip(parent_tokens, wanted.tokens, strict=False):
        if a != b:
            break
        shared += 1
    return shared - shared % wanted.step


def examine(bundle: Path, wanted: Wanted) -> tuple[Manifest | None, str | None]:
    """A bundle's manifest when its recorded facts allow it as a parent (worth validating), else
    None and why not. Only regular files are opened (check_folder first: a FIFO would block)."""
    try:
        check_folder(bundle)
        m = read_manifest(bundle, read_sums(bundle)[MANIFEST_FILE])
    except (BundleError, KeyError, OSError) as exc:
        return None, f"unreadable ({exc})"
    b = m.builder
    checks = (
        (m.model.fingerprint == wanted.identity.model, "built for other weights"),
        (m.cache.kv_bits is None, f"its cache is quantized ({m.cache.kv_bits}-bit)"),
        (set(m.cache.classes) == {"KVCache"}, "its cache has non-trimmable layers"),
        (
            m.cache.dtype == wanted.compute_dtype,
            f"it stores {m.cache.dtype}, this prefill computes in {wanted.compute_dtype}",
        ),
        (
            m.cache.prefill_step_size == wanted.step,
            f"chunks of {m.cache.prefill_step_size}, this build uses {wanted.step}",
        ),
        (
            (b.mlx, b.mlx_lm, b.device) == (wanted.builder.mlx, wanted.builder.mlx_lm, wanted.builder.device),
            f"built with mlx {b.mlx}, mlx-lm {b.mlx_lm} on {b.device}",
        ),
    )  # fmt: skip
    reason = next((why for ok, why in checks if not ok), None)
    return (None, reason) if reason else (m, None)


def _token_ids(bundle: Path) -> list[int]:
    """The ids a bundle's header carries (unverified: only to rank candidates)."""
    import json

    try:
        metadata = read_header(bundle / CACHE_FILE).metadata
        layout = detect_layout(metadata) or DEFAULT_LAYOUT
        ids = json.loads(user_metadata(metadata, layout).get("token_ids", "[]"))
    except (FormatError, OSError, ValueError):
        return []
    return ids if isinstance(ids, list) else []


def _load(bundle: Path, manifest: Manifest, wanted: Wanted) -> Resume | None:
    """The parent validated in full and loaded, its cache replayed up to the reusable tokens."""
    # the template changes the text, not the cache of given tokens: check the parent as built
    identity = dataclasses.replace(wanted.identity, template=manifest.model.template_sha256)
    try:
        checked = validate(bundle, identity, load=True, trust_memo=False)
    except BundleError:
        return None
    done = reusable_tokens(checked.tokens, wanted)
    if done == 0 or checked.cache is None:
        return None
    return Resume(
        _replay(checked.cache, done, wanted.step), done, _record(bundle, manifest, done), bundle
    )


def _replay(layers: list[Any], done: int, step: int) -> list[Any]:
    """Fresh KVCache layers holding the parent's first `done` positions in the buffers a full
    build has there: where each chunk grows mlx-lm's buffer by exactly `step` (a multiple of its
    growth step), the buffer is `done` long and a view of the parent is it; otherwise the
    positions are fed chunk by chunk through mlx-lm's own update."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    out = [KVCache() for _ in layers]
    if step % KVCache.step == 0:
        for fresh, layer in zip(out, layers, strict=True):
            fresh.keys, fresh.values = layer.keys[..., :done, :], layer.values[..., :done, :]
            fresh.offset = done
        return out
    for start in range(0, done, step):  # as the prefill does: every layer, then evaluate
        for fresh, layer in zip(out, layers, strict=True):
            end = start + step
            fresh.update_and_fetch(layer.keys[..., start:end, :], layer.values[..., start:end, :])
        mx.eval([c.state for c in out])
    return out


def _record(bundle: Path, manifest: Manifest, done: int) -> ParentInfo:
    p = manifest.prefix
    return ParentInfo(
        prefix=p.name,
        version=p.version,
        folder=bundle.name,
        file_sha256=manifest.cache.file_sha256,
        reused_tokens=done,
    )


def _reused_line(resume: Resume) -> str:
    p = resume.parent
    return f"reused {p.reused_tokens:,} tokens from {p.prefix}@{p.version} ({resume.path})"
