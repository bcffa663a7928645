"""Incremental builds: continue a bundle's stored KV at the exact shared token.

A child continues its parent as a server continues a cached prefix: its first N positions (N: the
whole shared token prefix) are the parent's stored K/V, unchanged, and only the new tokens are
prefilled on top, in chunks starting at N. A child is a deterministic function of its definition,
its model, the builder's kernels and its parent's bytes; `--full` builds from token 0 and is the
reference (a child differs from it in the last bits). A parent is continued only where its stored
state is what this build would hold there:
- same weights, same MLX, mlx-lm and device (the same kernels), same compute dtype;
- full-precision KVCache layers only (trimmable; no quantized, rotating or recurrent state),
  stored in the dtype this build stores (a bfloat16 parent on a float32 CPU builder is upcast
  exactly and the new tokens attend to its stored values, as a server's would); a quantized
  child (kv_bits) continues a full-precision parent and quantizes the whole cache at the end, as
  a build from token 0 does; a quantized parent is never continued (its rounding error would
  compound under every later version);
- the parent's chunk size does not matter: a continuation never depends on it.
The parent passes the one validator in full (both digests) before any of its bytes is used. Its
pins only prove it unchanged since someone wrote them; what proves the someone (PARENT_CHECKS):
- with trusted keys, its signature by one of them (required then): reused with no recompute;
- a parent this builder wrote (pipeline.builder.build_record, a private record outside the
  bundles tree): reused with no recompute;
- any other parent per `--parent-check`: `proven` (default) does not reuse it; `sample` and
  `chunks` recompute part of it (pipeline.builder.parent_checks): spot checks, not proofs.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.builder.build_record import built_here, recorded_before_manifests
from pipeline.builder.parent_checks import (
    SPOT_CHECK_DIFFERS,
    WINDOW,
    chunks_check,
    replay,
    sample_check,
    sample_windows,
)
from pipeline.builder.versioning import NOT_A_PREFIX
from pipeline.format.bundle_folder import (
    CACHE_FILE,
    MANIFEST_FILE,
    check_folder,
    model_folder,
    read_manifest,
    read_sums,
)
from pipeline.format.cache_codec import detect_layout, user_metadata
from pipeline.format.errors import BuildError, BundleError
from pipeline.format.fingerprint import ModelIdentity, sha256_file
from pipeline.format.manifest import (
    DEFAULT_LAYOUT,
    BuilderInfo,
    FidelityInfo,
    InheritedCheck,
    Manifest,
    ParentInfo,
)
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
    step: int  # prefill chunk size (the minimum worth continuing; see MIN_SHARED)
    layout: str = DEFAULT_LAYOUT  # the cache-file layout this build writes
    model: Any = None  # the loaded model, to recompute parts of a parent with (parent_checks)
    trusted_keys: tuple = ()  # with keys, a parent must carry a valid signature by one of them
    parent_check: str = "proven"  # what to do with a parent neither signed nor built here
    stored_dtype: str | None = None  # the dtype this build stores (None: compute_dtype)
    kv_bits: int | None = None  # this build quantizes its cache (a "continued-quantized" child)
    writes: tuple[str, int] | None = None  # the prefix name and version this build writes

    @property
    def stores(self) -> str:
        return self.stored_dtype or self.compute_dtype


@dataclass(frozen=True)
class Resume:
    """A prefill's starting point: the parent's cache up to `done` tokens, and its record."""

    cache: list[Any]
    done: int
    parent: ParentInfo
    path: Path
    refused: tuple[str, ...] = ()  # parents passed over after validation or the spot check, why
    inherited: InheritedCheck | None = None  # the serving comparison its first positions carry
    check_seconds: float = 0.0  # the spot check's time: for build-report.json, not the manifest


PARENT_ADVICE = "; pass another bundle or drop --parent to build from token 0"


def find_parent(
    bundles_root: Path, wanted: Wanted, exclude: Path, explicit: Path | None = None
) -> tuple[Resume | None, str]:
    """The usable parent reusing the most tokens (explicit: that one, else BuildError), and a
    line saying what was reused or why nothing was."""
    if explicit is not None:
        manifest, reason = examine(explicit, wanted)
        resume, reason = (None, reason) if manifest is None else _load(explicit, manifest, wanted)
        if resume is None:
            raise BuildError(f"--parent {explicit}: cannot be reused ({reason}){PARENT_ADVICE}")
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
        if reason:  # a bundle that would give tokens, passed over: one line says why
            refused.append(f"{path}: {reason}")
    if refused:
        return None, f"prefilled from token 0; {REFUSED_PARENT}: {'; '.join(refused)}"
    return None, f"no earlier bundle shares {NOT_ENOUGH} with these tokens"


def _same_model(why: str | None) -> bool:
    """A refusal by examine that concerns how a bundle of this model was built (worth a line)."""
    return bool(why) and not why.startswith((OTHER_WEIGHTS, "unreadable"))


OTHER_WEIGHTS = "built for other weights"


MIN_SHARED = 256  # tokens; a shared prefix shorter than this (or than a chunk) is not worth it
NOT_ENOUGH = "a prefill chunk's worth of tokens (or 256)"


def reusable_tokens(parent_tokens: list[int], wanted: Wanted) -> int:
    """Tokens a parent can give: its whole common prefix with the new ids, or 0 when that is
    shorter than a chunk or MIN_SHARED (a template's common opening is never worth validating
    and owing another bundle for)."""
    shared = 0
    for a, b in zip(parent_tokens, wanted.tokens, strict=False):
        if a != b:
            break
        shared += 1
    return shared if shared >= min(wanted.step, MIN_SHARED) else 0


def examine(bundle: Path, wanted: Wanted) -> tuple[Manifest | None, str | None]:
    """A bundle's manifest when its recorded facts allow it as a parent (worth validating), else
    None and why not. Only regular files are opened (check_folder first: a FIFO would block)."""
    try:
        check_folder(bundle)
        m = read_manifest(bundle, read_sums(bundle)[MANIFEST_FILE], kind=None)  # snapshot: why not
    except (BundleError, KeyError, OSError) as exc:
        return None, f"unreadable ({exc})"
    reason = _not_a_parent(m, wanted)
    return (None, reason) if reason else (m, None)


def _not_a_parent(m: Manifest, wanted: Wanted) -> str | None:
    """Why a manifest's recorded facts rule its bundle out as this build's parent (None: they
    allow it); asked of the manifest read first and again of the one the validator read."""
    foreign = _not_another_prefix(m, wanted)
    if foreign:
        return foreign
    b = m.builder
    checks = (
        (m.model.fingerprint == wanted.identity.model, OTHER_WEIGHTS),
        (
            m.cache.kv_bits is None,
            f"its cache is quantized ({m.cache.kv_bits}-bit): continuing quantized KV would "
            "compound its rounding error; a full-precision bundle of these tokens can be a parent",
        ),
        (set(m.cache.classes) == {"KVCache"}, "its cache has non-trimmable layers"),
        (
            m.cache.dtype == wanted.stores,
            f"it stores {m.cache.dtype}, this build stores {wanted.stores}",
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
        (
            b.compute_dtype == wanted.builder.compute_dtype,
            f"computed with compute_dtype {b.compute_dtype}, this build "
            f"{wanted.builder.compute_dtype}",
        ),
    )  # fmt: skip
    return next((why for ok, why in checks if not ok), None)


def _not_another_prefix(m: Manifest, wanted: Wanted) -> str | None:
    """Why a manifest is no other prefix bundle: a runtime snapshot, or the bundle this build
    writes (its prefix, version and weights), which a copy of it would continue as itself."""
    if m.prefix is None:
        return f"it is a {NOT_A_PREFIX.rstrip(',')}"
    if (
        m.prefix.name,
        m.prefix.version,
    ) == wanted.writes and m.model.fingerprint == wanted.identity.model:
        return (
            f"it is {m.prefix.name}@{m.prefix.version} for these weights: the bundle this build "
            "writes, or a copy of it"
        )
    return None


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
REFUSED_PARENT = "refused as a parent"
UNPROVEN = "neither signed by a --trusted-key nor built by this builder"


def _load(bundle: Path, manifest: Manifest, wanted: Wanted) -> tuple[Resume | None, str | None]:
    """The parent validated in full, proven (signature, build record or the chosen check) and
    loaded, its first reusable positions in fresh cache layers; or None and why not."""
    # the template changes the text, not the cache of given tokens: check the parent as built
    identity = dataclasses.replace(wanted.identity, template=manifest.model.template_sha256)
    keys = {"trusted_keys": wanted.trusted_keys} if wanted.trusted_keys else {}
    try:
        # one read: hashed unless this user's memo vouches for the file as it is (its build
        # hashed it and carried the entry to where it was published)
        checked = validate(bundle, identity, load=True, trust_memo=True, **keys)
    except BundleError as exc:
        return None, f"refused by the validator: {exc.reason}"
    reason = _not_a_parent(checked.manifest, wanted)  # the folder may have changed since
    if reason:
        return None, reason
    done = reusable_tokens(checked.tokens, wanted)
    if done == 0 or checked.cache is None:
        return None, f"it shares less than {NOT_ENOUGH} with these tokens"
    start = time.perf_counter()
    how = _prove(checked, wanted, done)
    if how.startswith(SPOT_CHECK_DIFFERS) or how.startswith(UNPROVEN_REFUSAL):
        return None, how
    if how.startswith(SPOT_CHECKED) and not _sha256_pinned(bundle, checked.manifest):
        # unsigned and not built here: its manifest is as anyone wrote it, so the sha256 it pins
        # (what the child records of it) is checked too, not only the BLAKE3 the read checked
        return None, f"refused by the validator: {CACHE_FILE} does not have the sha256 it pins"
    seconds = time.perf_counter() - start  # the manifest says how, identical builds alike
    import mlx.core as mx

    cache = replay(checked.cache, done, getattr(mx, wanted.compute_dtype))
    record = _record(checked, done, how, wanted)
    inherited = _inherited(checked, done)
    return Resume(cache, done, record, bundle, inherited=inherited, check_seconds=seconds), None


UNPROVEN_REFUSAL = f"not reused: {UNPROVEN}"
SPOT_CHECKED = "spot check: "  # how a parent reused on a spot check is recorded (parent.checked)


def proven_lineage(manifest: Manifest) -> bool:
    """Whether every token of a bundle is proven: built from token 0, or continuing a parent
    that was signed, built here or recomputed (never one reused on a spot check: a spot check
    is not a proof, and neither the build record nor a signature may turn it into one)."""
    checked = manifest.parent.checked if manifest.parent is not None else ""
    return checked is not None and not checked.startswith(SPOT_CHECKED)


def _prove(checked: Validated, wanted: Wanted, done: int) -> str:
    """How the parent is trusted, as the manifest records it; or why it is not (a refusal that
    starts with UNPROVEN_REFUSAL or SPOT_CHECK_DIFFERS)."""
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
        problem = sample_check(wanted.model, layers, checked.tokens, done)
        if problem:
            return problem
        return (
            f"{SPOT_CHECKED}{UNPROVEN}; two {WINDOW}-token windows recomputed (tokens "
            f"{sample_windows(done)}) matched within tolerance"
        )
    unavailable = _chunks_unavailable(manifest, wanted)
    if unavailable:
        return unavailable
    step = manifest.cache.prefill_step_size
    chunks = chunks_check(wanted.model, layers, checked.tokens, done, step)
    if isinstance(chunks, str):
        return chunks
    which = " and ".join(map(str, chunks))
    return (
        f"{SPOT_CHECKED}{UNPROVEN}; its chunk {which} of {step} tokens (holding the first and the "
        f"last of the {done:,} reused) recomputed from token 0 and byte-identical"
    )


def _chunks_unavailable(manifest: Manifest, wanted: Wanted) -> str | None:
    """Why the chunks check cannot recompute this parent byte for byte, if it cannot: only a
    parent built from token 0 in the dtype it stores holds K/V its own chunks reproduce."""
    if manifest.parent is not None:
        why = f"this one continued {manifest.parent.prefix}@{manifest.parent.version}"
    elif manifest.cache.dtype != wanted.compute_dtype:
        why = f"this one stores {manifest.cache.dtype}, computed in {wanted.compute_dtype}"
    else:
        return None
    return (
        f"{UNPROVEN_REFUSAL}; --parent-check chunks recomputes a parent byte for byte, which "
        f"needs one built from token 0 that stores its compute dtype ({why}); pass "
        "--parent-check sample, or sign it and pass --trusted-key"
    )


def _sha256_pinned(bundle: Path, manifest: Manifest) -> bool:
    """Whether the bundle's cache file has the sha256 its manifest pins."""
    try:
        return sha256_file(bundle / CACHE_FILE) == manifest.cache.file_sha256
    except OSError:  # gone since it was validated: not this parent
        return False


def _record(parent: Validated, done: int, how: str, wanted: Wanted) -> ParentInfo:
    p, m = parent.manifest.prefix, parent.manifest
    return ParentInfo(
        prefix=p.name,
        version=p.version,
        folder=model_folder(m.model.slug, m.model.fingerprint),  # as the layout names it
        file_sha256=m.cache.file_sha256,
        reused_tokens=done,
        checked=how,
        manifest_sha256=parent.manifest_sha256,
        kernels=m.builder.kernels,
        kind="continued-quantized" if wanted.kv_bits else "continued",
        stored_dtype=m.cache.dtype,
    )


def _inherited(parent: Validated, done: int) -> InheritedCheck | None:
    """The serving-path comparison that covers the child's first `done` positions: the parent's
    own, or the one it inherited (for the positions it holds of that bundle)."""
    m = parent.manifest
    if m.fidelity.serving is not None:
        where = f"{m.prefix.name}@{m.prefix.version}/{parent.path.name}"
        return InheritedCheck(bundle=where, tokens=done, serving=m.fidelity.serving)
    older = m.fidelity.inherited
    if older is None:
        return None
    return older.model_copy(update={"tokens": min(done, older.tokens)})


def _reused_line(resume: Resume) -> str:
    p = resume.parent
    line = f"reused {p.reused_tokens:,} tokens from {p.prefix}@{p.version} ({resume.path})"
    return f"{line}; {REFUSED_PARENT}: {'; '.join(resume.refused)}" if resume.refused else line


def continued_reference(
    fidelity: FidelityInfo, parent: ParentInfo, inherited: InheritedCheck | None
) -> FidelityInfo:
    """The fidelity record of a child: what its reference run was (the continuation), and the
    serving comparison it inherits when it ran none of its own."""
    where = f"{parent.prefix}@{parent.version}/{parent.folder}"
    held = "quantized with the rest" if parent.kind == "continued-quantized" else "as stored"
    note = (
        f"continued from parent {where} at token {parent.reused_tokens:,} (cache sha256 "
        f"{parent.file_sha256[:16]}..): its {parent.stored_dtype} K/V {held}, the new tokens "
        "prefilled on top; not an independent prefill from token 0"
    )
    update: dict[str, Any] = {"reference": f"{fidelity.reference}; {note}"}
    if fidelity.serving is None and fidelity.checked:
        update["inherited"] = inherited
    return fidelity.model_copy(update=update)
