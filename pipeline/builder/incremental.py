"""Incremental builds: start the prefill from a bundle that already holds the new tokens' prefix.

The result must be byte-identical to a build from token 0, so a parent is used only where its
stored state IS the state a full build has at a chunk boundary:
- same weights, same MLX, mlx-lm and device (the same kernels), same prefill chunk size;
- full-precision KVCache layers only (trimmable; no quantized, rotating or recurrent state),
  stored in the dtype this build prefills in (the builder casts to the serving dtype at the end,
  so a bfloat16 bundle prefilled in float32 does not hold the float32 state);
- reuse stops at the last multiple of the chunk size at or below the shared token prefix, so the
  remaining chunks are exactly the full build's chunks.
The parent passes the one validator in full (both digests) before any of its bytes is used. Its
pins only prove it unchanged since someone wrote them; what proves the someone (PARENT_CHECKS):
- with trusted keys, its signature by one of them (required then): reused with no recompute;
- a parent this builder wrote (pipeline.builder.build_record, a private record outside the
  bundles tree): reused with no recompute;
- any other parent per `--parent-check`: `proven` (default) does not reuse it; `sample`
  recomputes two 64-token windows (token 0 from nothing, and the start of the last reused chunk
  from the parent's earlier chunks) and compares them within a float tolerance, which catches a
  gross edit at a cost of ~2 x 64 tokens and is a spot check, not a proof; `chunks` recomputes
  chunk 0 and the last reused chunk in full and compares every byte (about two chunks of prefill,
  and still no proof: whoever can write a parent can recompute the later chunks from a forged one).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.builder.build_record import built_here, recorded_before_manifests
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
from pipeline.format.manifest import DEFAULT_LAYOUT, BuilderInfo, FidelityInfo, Manifest, ParentInfo
from pipeline.format.safetensors_read import FormatError, read_header
from pipeline.format.validate import Validated, validate
from pipeline.runtime.mount import find_bundles


@dataclass(frozen=True)
class Wanted:
    """What this build needs of a parent."""

    tokens: list[int]
    identity: ModelIdentity
    builder: BuilderInfo
    compute_dtype: str  # the dtype the prefill holds its cache in
    step: int  # prefill chunk size
    layout: str = DEFAULT_LAYOUT  # the cache-file layout this build writes
    model: Any = None  # the loaded model, to recompute chunks of a parent with (spot_check)
    trusted_keys: tuple = ()  # with keys, a parent must carry a valid signature by one of them
    parent_check: str = "proven"  # what to do with a parent neither signed nor built here


@dataclass(frozen=True)
class Resume:
    """A prefill's starting point: the parent's cache up to `done` tokens, and its record."""

    cache: list[Any]
    done: int
    parent: ParentInfo
    path: Path
    refused: tuple[str, ...] = ()  # parents passed over after validation or the spot check, why


def find_parent(
    bundles_root: Path, wanted: Wanted, exclude: Path, explicit: Path | None = None
) -> tuple[Resume | None, str]:
    """The usable parent reusing the most tokens (explicit: that one, else BuildError), and a
    line saying what was reused or why nothing was."""
    if explicit is not None:
        manifest, reason = examine(explicit, wanted)
        resume, reason = (None, reason) if manifest is None else _load(explicit, manifest, wanted)
        if resume is None:
            raise BuildError(
                f"--parent {explicit}: cannot be reused ({reason}); "
                "pass another bundle or drop --parent to build from token 0"
            )
        return resume, _reused_line(resume)
    try:
        found, _ = find_bundles(bundles_root)
    except BundleError:
        return None, "no earlier bundles to start from"
    candidates, refused = [], []
    for path in (p for p in found if p.resolve() != exclude.resolve()):
        manifest, why = examine(path, wanted)
        reused = reusable_tokens(_token_ids(path), wanted) if manifest or _same_model(why) else 0
        if manifest is not None:
            candidates.append((reused, str(path), path, manifest))
        elif reused:  # this model's bundle that would give tokens: say why it does not
            refused.append(f"{path}: {why}")
    for reused, _, path, manifest in sorted(candidates, key=lambda c: (-c[0], c[1])):
        if reused == 0:
            break
        resume, reason = _load(path, manifest, wanted)
        if resume is not None:
            resume = dataclasses.replace(resume, refused=tuple(refused))
            return resume, _reused_line(resume)
        if reason and reason.startswith((SPOT_CHECK, UNPROVEN_REFUSAL)):
            refused.append(f"{path}: {reason}")
    if refused:
        return None, f"prefilled from token 0; {REFUSED_PARENT}: {'; '.join(refused)}"
    return None, "no earlier bundle shares a whole prefill chunk with these tokens"


def _same_model(why: str | None) -> bool:
    """A refusal by examine that concerns how a bundle of this model was built (worth a line)."""
    return bool(why) and not why.startswith((OTHER_WEIGHTS, "unreadable"))


OTHER_WEIGHTS = "built for other weights"


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
        (m.model.fingerprint == wanted.identity.model, OTHER_WEIGHTS),
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
            m.cache.layout == wanted.layout,
            f"its cache file has the {m.cache.layout} layout, this build writes {wanted.layout}",
        ),
        (
            b.kernels is not None,
            "format 2: it does not record which kernels made it, so it is recomputed from token "
            "0 once (its rebuild records them)",
        ),
        (
            (b.mlx, b.mlx_lm, b.device, b.kernels) == (wanted.builder.mlx, wanted.builder.mlx_lm, wanted.builder.device, wanted.builder.kernels),
            f"made by other kernels (mlx {b.mlx}, mlx-lm {b.mlx_lm} on {b.device}: {b.kernels}; "
            f"this build: {wanted.builder.kernels})",
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


PARENT_CHECKS = ("proven", "sample", "chunks")
SPOT_CHECK = "recomputed from token 0"
REFUSED_PARENT = "refused as a parent"
UNPROVEN = "neither signed by a --trusted-key nor built by this builder"
WINDOW = 64  # tokens per window of the sample check


def _load(bundle: Path, manifest: Manifest, wanted: Wanted) -> tuple[Resume | None, str | None]:
    """The parent validated in full, proven (signature, build record or the chosen check) and
    loaded, its cache replayed up to the reusable tokens; or None and why not."""
    # the template changes the text, not the cache of given tokens: check the parent as built
    identity = dataclasses.replace(wanted.identity, template=manifest.model.template_sha256)
    keys = {"trusted_keys": wanted.trusted_keys} if wanted.trusted_keys else {}
    try:
        checked = validate(bundle, identity, load=True, trust_memo=False, **keys)
    except BundleError as exc:
        return None, f"refused by the validator: {exc.reason}"
    done = reusable_tokens(checked.tokens, wanted)
    if done == 0 or checked.cache is None:
        return None, "it shares no whole prefill chunk with these tokens"
    start = time.perf_counter()
    how = _prove(checked, wanted, done)
    if how.startswith(SPOT_CHECK) or how.startswith(UNPROVEN_REFUSAL):
        return None, how
    how += f" ({time.perf_counter() - start:.2f} s)" if how.startswith("spot check") else ""
    record = _record(checked, done, how)
    return Resume(_replay(checked.cache, done, wanted.step), done, record, bundle), None


UNPROVEN_REFUSAL = f"not reused: {UNPROVEN}"


def _prove(checked: Validated, wanted: Wanted, done: int) -> str:
    """How the parent is trusted, as the manifest records it; or why it is not (a refusal that
    starts with UNPROVEN_REFUSAL or SPOT_CHECK)."""
    layers, manifest = checked.cache, checked.manifest
    if wanted.trusted_keys:
        return "signed by a trusted key (validated: no recompute)"
    if built_here(checked.manifest_sha256, manifest):
        return "built by this builder (its private build record pins this manifest: no recompute)"
    if wanted.parent_check == "proven":
        older = (
            " (the build record names its cache file from before records pinned manifests: "
            "recomputed from token 0 once)"
            if recorded_before_manifests(manifest)
            else ""
        )
        return (
            f"{UNPROVEN_REFUSAL}{older}; sign it and pass --trusted-key, or pass --parent-check "
            "sample (spot check) or chunks to reuse it anyway"
        )
    if wanted.parent_check == "sample":
        problem = sample_check(wanted.model, layers, wanted.tokens, done, wanted.step)
        if problem:
            return problem
        return (
            f"spot check: {UNPROVEN}; two {WINDOW}-token windows recomputed (token 0, and the "
            f"start of chunk {done // wanted.step - 1}) matched within tolerance"
        )
    chunks = spot_check(wanted.model, layers, wanted.tokens, done, wanted.step)
    if isinstance(chunks, str):
        return chunks
    which = " and ".join(map(str, chunks))
    return (
        f"spot check: {UNPROVEN}; chunk {which} of the {done // wanted.step} reused chunks of "
        f"{wanted.step} tokens recomputed from token 0 and byte-identical"
    )


def sample_check(
    model: Any, layers: list[Any], tokens: list[int], done: int, step: int
) -> str | None:
    """Recompute a short window at token 0 and at the start of the last reused chunk and compare
    with the parent's K/V within a float tolerance (a shorter chunk than the build's differs in
    the last bits); None when both match, else what differs. A spot check: it finds a gross edit
    of what it looks at, nothing else."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    for start in sorted({0, done - step}):
        end = start + min(WINDOW, step)
        cache = _replay(layers, start, step) if start else [KVCache() for _ in layers]
        model(mx.array(tokens[start:end])[None], cache=cache)
        mx.eval([c.state for c in cache])
        for i, (fresh, old) in enumerate(zip(cache, layers, strict=True)):
            for kind, got, want in (("keys", fresh.keys, old.keys), ("values", fresh.values, old.values)):  # fmt: skip
                a, b = got[..., start:end, :], want[..., start:end, :]
                if not mx.allclose(a, b, rtol=1e-3, atol=1e-4).item():
                    return (
                        f"{SPOT_CHECK}, tokens {start}-{end} differ from the parent's in layer "
                        f"{i} {kind} beyond float tolerance: altered, or built differently"
                    )
    return None


def spot_check(
    model: Any, layers: list[Any], tokens: list[int], done: int, step: int
) -> list[int] | str:
    """Recompute chunk 0 from token 0, and the last reused chunk from the parent's earlier ones;
    the chunks checked when every K/V byte is the parent's, else what differs."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    checked = sorted({0, done // step - 1})
    for index in checked:
        start, end = index * step, (index + 1) * step
        cache = _replay(layers, start, step) if start else [KVCache() for _ in layers]
        model(mx.array(tokens[start:end])[None], cache=cache)
        mx.eval([c.state for c in cache])
        for i, (fresh, old) in enumerate(zip(cache, layers, strict=True)):
            for kind, got, want in (("keys", fresh.keys, old.keys), ("values", fresh.values, old.values)):  # fmt: skip
                if not mx.array_equal(got[..., start:end, :], want[..., start:end, :]).item():
                    return (
                        f"{SPOT_CHECK}, chunk {index} (tokens {start}-{end}) differs from the "
                        f"parent's in layer {i} {kind}: altered, or built differently"
                    )
    return checked


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


def _record(parent: Validated, done: int, how: str) -> ParentInfo:
    p, m = parent.manifest.prefix, parent.manifest
    return ParentInfo(
        prefix=p.name,
        version=p.version,
        folder=parent.path.name,
        file_sha256=m.cache.file_sha256,
        reused_tokens=done,
        checked=how,
        manifest_sha256=parent.manifest_sha256,
        kernels=m.builder.kernels,
    )


def _reused_line(resume: Resume) -> str:
    p = resume.parent
    line = f"reused {p.reused_tokens:,} tokens from {p.prefix}@{p.version} ({resume.path})"
    return f"{line}; {REFUSED_PARENT}: {'; '.join(resume.refused)}" if resume.refused else line


def continued_reference(fidelity: FidelityInfo, parent: ParentInfo) -> FidelityInfo:
    """The fidelity record of a child: its reference prefill continued from the parent too."""
    where = f"{parent.prefix}@{parent.version}/{parent.folder}"
    note = (
        f"continued from parent {where} at token {parent.reused_tokens:,} (cache sha256 "
        f"{parent.file_sha256[:16]}..): not an independent prefill from token 0"
    )
    return fidelity.model_copy(update={"reference": f"{fidelity.reference}; {note}"})
