"""Orchestrates definition -> rendered text -> tokens -> prefill -> bundle. No printing, no argv."""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import Timeout as LockTimeout

from pipeline import __version__
from pipeline.blas import blas_status
from pipeline.builder.build_record import record_built
from pipeline.builder.definition import LoadedDefinition
from pipeline.builder.fidelity import run_checks
from pipeline.builder.incremental import (
    PARENT_ADVICE,
    REFUSED_PARENT,
    Resume,
    Wanted,
    continued_reference,
    find_parent,
    proven_lineage,
)
from pipeline.builder.prefill import (
    Progress,
    cache_nbytes,
    check_blocks,
    check_context,
    check_group_size,
    dtype_name,
    encode,
    estimate_bytes,
    finalize_cache,
    load_model,
    prefill,
    quantize_cache,
    resolve_compute,
)
from pipeline.builder.render import Rendered, check_rendered, render_prefix
from pipeline.builder.server_ids import check_servers, request_info, server_cut, versions
from pipeline.builder.signing import sign_bundle, sign_manifest, signed_by
from pipeline.builder.stability import StableCut, stable_prefix
from pipeline.builder.targets import Target
from pipeline.builder.versioning import check_destination, check_version
from pipeline.builder.writer import (
    discard,
    free_bytes,
    new_staging_folder,
    publish,
    target_lock,
    write_cache,
)
from pipeline.format import memo
from pipeline.format.bundle_folder import CACHE_FILE, MANIFEST_FILE, bundle_path
from pipeline.format.bundle_writer import block_record, write_bundle_files
from pipeline.format.cache_codec import write_failure
from pipeline.format.compat import layout_for, unsupported
from pipeline.format.errors import BuildError, BundleError, ModelError
from pipeline.format.fingerprint import (
    FileDigests,
    ModelIdentity,
    canonical_json,
    folder_state,
    sha256_bytes,
)
from pipeline.format.lockfile import Lockfile
from pipeline.format.manifest import (
    DEFAULT_LAYOUT,
    FORMAT_VERSION,
    BlocksInfo,
    BuilderInfo,
    CacheInfo,
    FidelityInfo,
    InheritedCheck,
    Manifest,
    ModelInfo,
    ParentInfo,
    PrefixInfo,
    TextInfo,
    TokenInfo,
    manifest_bytes,
)
from pipeline.format.secret_key import SecretKey
from pipeline.format.served_identity import changed_message, settled_identity
from pipeline.format.validate import validate


@dataclass(frozen=True)
class BuildResult:
    bundle: Path
    manifest: Manifest
    report: dict[str, Any]
    up_to_date: bool

    @property
    def advice(self) -> str | None:
        """A warning worth printing about this bundle, if any (a prefix too short to pay off)."""
        tokens = self.manifest.tokens.count
        if tokens >= CROSSOVER_TOKENS:
            return None
        return (
            f"{self.bundle}: the prefix is {tokens} tokens, below the measured crossover of "
            f"{CROSSOVER_TOKENS} tokens (the project's restart benchmark) under which mounting a bundle can cost "
            "more than prefilling it; consider a longer prefix or no bundle"
        )


# Below this many tokens a mounted bundle was not measured to beat a cold prefill (bench case 2:
# restart first token, crossover linear through the two shortest lengths; 82 in the committed
# run, 81 and 18 in earlier ones: the estimate is noisy, so the warning takes the largest).
CROSSOVER_TOKENS = 82


def build_key(
    target: Target, identity: ModelIdentity, rendered: Rendered, builder: BuilderInfo
) -> str:
    """Hash of every input that changes the bundle's bytes."""
    d = target.definition
    return sha256_bytes(
        canonical_json(
            {
                "format": FORMAT_VERSION,
                "prefix": [d.name, d.version, d.content_sha256],
                "text": sha256_bytes(rendered.text.encode()),
                "model": [
                    identity.model,
                    identity.tokenizer,
                    rendered.template_sha256,
                    target.model_ref,
                ],
                "cache": d.spec.cache.model_dump(),
                "check": d.spec.check.model_dump(),
                "builder": builder.model_dump(),
                "servers": {s: versions(s) for s in d.spec.servers},
                "api": d.spec.api,
            }
        )
    )


def existing_manifest(bundle: Path, identity: ModelIdentity) -> Manifest | None:
    """The manifest of a bundle already at `bundle` that the validator accepts, else None."""
    if not bundle.is_dir():
        return None
    try:
        return validate(bundle, identity).manifest
    except BundleError:
        return None


def preview(text: str, width: int = 120) -> str:
    """First and last characters of the rendered text."""
    if len(text) <= 2 * width:
        return text
    return f"{text[:width]} [...] {text[-width:]}"


def builder_info(compute: str | None = None) -> BuilderInfo:
    """Versions and device of this builder (part of the build key)."""
    import mlx.core as mx
    from mlx_lm import __version__ as mlx_lm_version

    from pipeline.builder.kernels import kernels
    from pipeline.builder.prefill import device_label

    if layout_for(mlx_lm_version) is None:
        raise BuildError(unsupported(mlx_lm_version))
    return BuilderInfo(
        pipeline=__version__,
        mlx=mx.__version__,
        mlx_lm=mlx_lm_version,
        platform=f"{platform.system()} {platform.machine()} python{platform.python_version()}",
        device=device_label(),
        compute_dtype=resolve_compute(compute),
        kernels=kernels(),
    )


def build(
    target: Target,
    bundles_root: Path,
    *,
    force: bool = False,
    check: bool = False,
    progress: Progress | None = None,
    lock: Lockfile | None = None,
    parent: Path | None = None,
    incremental: bool = True,
    sign_key: SecretKey | None = None,
    trusted_keys: tuple = (),
    parent_check: str = "proven",
) -> BuildResult:
    """Build one bundle (or report it up to date); the folder appears complete or not at all.

    incremental: continue the bundle under bundles_root that shares the most tokens with these
    at the exact shared token, when one is proven and made by this build's kernels (pipeline.
    builder.incremental); parent: continue this bundle or fail; sign_key: add manifest.json.minisig
    before the bundle is published (an up-to-date bundle is signed in place); trusted_keys: a
    parent must carry a valid signature by one of them."""
    d = target.definition
    # with the cache state its architecture builds; the folder's state proves the load read these
    identity, state = settled_identity(target.model_dir)
    if target.expected_fingerprint and target.expected_fingerprint != identity.model:
        raise ModelError(
            f"model {target.model_dir}: fingerprint {identity.model[:12]}.. differs from the "
            f"definition's models.fingerprint {target.expected_fingerprint[:12]}..; "
            "update the pin if the new weights are intended"
        )
    if parent is not None and not parent.is_dir():
        raise BuildError(f"--parent {parent}: no such bundle folder; pass a bundle's folder")
    parent = parent.resolve() if parent is not None else None  # recorded by its real folder
    check_version(d, bundles_root, lock or Lockfile())
    check_group_size(d, identity.shape.head_dim)
    rendered = render_prefix(d, target.model_dir)
    # the bundle is for a server that renders with the pinned template (the model's or a file)
    identity = dataclasses.replace(identity, template=rendered.template_sha256)
    check_rendered(d, rendered.text)
    check_servers(d)
    builder = builder_info(d.spec.cache.compute_dtype)
    key = build_key(target, identity, rendered, builder)
    dest = bundle_path(bundles_root, d.name, d.version, target.slug, identity.model)
    check_destination(dest)
    if parent is not None and parent == dest.resolve():
        raise BuildError(
            f"--parent {parent}: that is the bundle this build writes; pass the bundle it "
            "continues (an older version or another prefix), or drop --parent"
        )
    current = None if force else existing_manifest(dest, identity)
    reuse = parent if parent is not None else incremental
    job = Job(target, identity, rendered, builder, key, dest, check, progress, reuse, sign_key)
    job = dataclasses.replace(
        job, trusted_keys=tuple(trusted_keys), parent_check=parent_check, state=state
    )
    up_to_date = current is not None and current.build_key == key
    # --full asks for a bundle that owes no parent anything: a child is not that
    up_to_date = up_to_date and not (reuse is False and current.parent is not None)
    if up_to_date and (sign_key is None or _signed_already(job)):
        return BuildResult(dest, current, {}, up_to_date=True)
    try:
        with target_lock(bundles_root, dest):
            if up_to_date:  # to be signed, but nothing proves its bytes: rebuild and compare
                return _prove_and_sign(job, bundles_root, current)
            return _build_locked(job, bundles_root)
    except LockTimeout:
        raise BuildError(
            f"another build is writing {dest} right now; wait for it to finish (its bundle is kept)"
        ) from None
    except OSError as exc:
        # a name relative to a folder descriptor (format.safe_tree) is shown under the bundles root
        name = os.fsdecode(exc.filename) if exc.filename else ""
        where = name if os.path.isabs(name) else f"{name} under {bundles_root}" if name else ""
        raise BuildError(
            f"cannot write {where or bundles_root}: {exc.strerror}; "
            "make the bundles folder writable or pass --bundles"
        ) from None


@dataclass(frozen=True)
class Job:
    """One bundle to build, with everything established before the model is loaded."""

    target: Target
    identity: ModelIdentity
    rendered: Rendered
    builder: BuilderInfo
    key: str
    dest: Path
    check: bool
    progress: Progress | None
    reuse: Path | bool  # a parent bundle to start from, or whether to look for one
    sign_key: SecretKey | None = None  # sign before publishing (pipeline.builder.signing)
    trusted_keys: tuple = ()  # a parent must be signed by one of these (incremental.Wanted)
    parent_check: str = "proven"  # a parent neither signed nor built here (incremental.Wanted)
    state: tuple[str, ...] = ()  # the model folder as fingerprinted (fingerprint.folder_state)


def _signed_already(job: Job) -> bool:
    """An up-to-date bundle whose signature by the signing key or a trusted key verifies is
    proven; a trusted signature by another key gets the signing key's in its place."""
    own = job.sign_key.public_key()
    if signed_by(job.dest, [own]):
        return True
    if signed_by(job.dest, job.trusted_keys):
        sign_bundle(job.dest, job.sign_key, replace=True)  # under the bundle's build lock
        return True
    return False


def _prove_and_sign(job: Job, bundles_root: Path, current: Manifest) -> BuildResult:
    """Rebuild an up-to-date but unproven bundle as it was made (from token 0, or a child from
    the parent it names, which must still be there and proven) and sign it only when it is what
    this build produces; BuildError when not (it was altered after it was built)."""
    tmp = new_staging_folder(bundles_root)
    how = "from token 0" if current.parent is None else "from its parent"
    try:
        proof = dataclasses.replace(
            job, reuse=_recorded_parent(bundles_root, current), sign_key=None,
            check=current.fidelity.checked,
        )  # fmt: skip
        try:
            rebuilt, _ = _produce(proof, bundles_root, tmp)
        except BuildError as exc:  # the parent it names (not a --parent the user passed)
            said = str(exc).removesuffix(PARENT_ADVICE)
            raise BuildError(
                f"{job.dest}: --sign-key: it is signed only once rebuilt as it was made {how}, "
                f"and that failed ({said}); rebuild it with 'prefix-bundles build --force "
                "--sign-key KEY'"
            ) from None
        _refuse_to_vouch(job.dest, rebuilt)
        different = _first_difference(tmp, job.dest, rebuilt, current)
        if different is not None:
            raise BuildError(
                f"{job.dest}: {different} differs from what this build produces {how}, "
                "so the bundle was altered after it was built (or its parent was) and is not "
                "signed; rebuild it with 'prefix-bundles build --force --sign-key KEY'"
            )
        v = validate(job.dest, job.identity)  # SHA256SUMS, every byte as the manifest pins them
        signature = sign_manifest(job.dest, job.sign_key, v.manifest_sha256)
    finally:
        discard(bundles_root, tmp)
    report = {"signed": f"rebuilt {how} and compared", "key": signature.key}
    return BuildResult(job.dest, current, report, up_to_date=True)


def _refuse_to_vouch(dest: Path, manifest: Manifest) -> None:
    """A signature goes only on proven bytes: BuildError for a bundle whose parent was reused on
    a spot check (--parent-check sample|chunks), before anything is signed or published."""
    if not proven_lineage(manifest):
        raise BuildError(
            f"{dest}: --sign-key: it continues {manifest.parent.prefix}@{manifest.parent.version} "
            "reused on a spot check, which is not a proof, and a signature vouches for every "
            "byte; sign the parent and pass --trusted-key, or build it with --full"
        )


def _recorded_parent(bundles_root: Path, current: Manifest) -> Path | bool:
    """The parent folder a child names (its rebuild continues it: BuildError when it is gone),
    or False for a bundle built from token 0."""
    p = current.parent
    if p is None:
        return False
    folder = bundles_root / p.prefix / str(p.version) / p.folder
    if not folder.is_dir():
        raise BuildError(
            f"{folder}: the parent this bundle continued is gone, so its bytes cannot be "
            "reproduced to sign them; rebuild it with 'prefix-bundles build --force --sign-key KEY'"
        )
    return folder


def _first_difference(
    rebuilt_dir: Path, dest: Path, rebuilt: Manifest, current: Manifest
) -> str | None:
    """What differs between a rebuild and a bundle: the cache file byte for byte, the manifest
    field by field (but for how a child's parent was trusted: a signature may have replaced the
    build record since, for the same parent manifest)."""
    import filecmp

    target = dest / CACHE_FILE
    if target.is_symlink() or not target.is_file():
        return CACHE_FILE
    if not filecmp.cmp(rebuilt_dir / CACHE_FILE, target, shallow=False):
        return CACHE_FILE
    exclude: dict[str, Any] = {"parent": {"checked"}} if current.parent else {}
    if rebuilt.model_dump(exclude=exclude) != current.model_dump(exclude=exclude):
        return MANIFEST_FILE
    return None


def _build_locked(job: Job, bundles_root: Path) -> BuildResult:
    tmp = new_staging_folder(bundles_root)  # proves the bundles folder is writable, before prefill
    try:
        manifest, report = _produce(job, bundles_root, tmp)
        hashed = _hashed_key(tmp / CACHE_FILE, manifest)
        if job.sign_key is not None:
            _refuse_to_vouch(job.dest, manifest)
            sign_manifest(tmp, job.sign_key)
        publish(bundles_root, tmp, job.dest)
        if proven_lineage(manifest):  # a later build may reuse it with no recompute (or hash)
            record_built(sha256_bytes(manifest_bytes(manifest)), manifest)
        _carry_hash(hashed, job.dest / CACHE_FILE, manifest)
        return BuildResult(job.dest, manifest, report, up_to_date=False)
    finally:
        discard(bundles_root, tmp)


def _hashed_key(cache_file: Path, manifest: Manifest) -> str | None:
    """The memo key under which the self-check hashed the staged cache file (from the file it
    read), when the file's stat is still that one; else None."""
    key = memo.stat_key(cache_file)
    return key if memo.lookup(key) == manifest.cache.file_blake3 else None


def _carry_hash(key: str | None, published: Path, manifest: Manifest) -> None:
    """Vouch for the published cache file as hashed: publishing renames its folder, which leaves
    the file's size, times, inode and device as they were hashed, so only the path changes (an
    edit since changes its ctime and misses). A child continuing it then reads it once, to load."""
    if key is not None:
        memo.store(
            f"{os.path.realpath(published)}|{key.split('|', 1)[1]}", manifest.cache.file_blake3
        )


def _produce(job: Job, bundles_root: Path, tmp: Path) -> tuple[Manifest, dict[str, Any]]:
    """Prefill and write the bundle into the staging folder `tmp`, validated."""
    d = job.target.definition
    started = began = time.perf_counter()
    loaded = load_model(job.target.model_dir, d.spec.cache.compute_dtype)
    load_seconds = time.perf_counter() - began
    cut = _stable_cut(job, loaded.tokenizer)
    check_context(d, len(cut.tokens), job.identity.shape)
    check_blocks(d, len(cut.tokens), job.identity.shape, loaded.serving_dtype, d.spec.cache.kv_bits)
    needed = estimate_bytes(
        len(cut.tokens), job.identity.shape, loaded.serving_dtype, d.spec.cache.kv_bits
    )
    check_room(bundles_root, needed)
    looked = time.perf_counter()
    resume, reuse_note = _resume(job, loaded, cut.tokens, bundles_root)
    parent_seconds = time.perf_counter() - looked  # finding, validating and proving a parent
    start = (resume.cache, resume.done) if resume else None
    cache, stats = prefill(loaded, cut.tokens, d.spec.cache.prefill_step_size, job.progress, start)
    parent = resume.parent if resume else None
    inherited = resume.inherited if resume else None
    check_seconds = round(resume.check_seconds, 4) if resume else 0.0
    del resume, start  # the parent's arrays: the prefill's cache holds what it needs
    report_extra = {
        "reused_tokens": parent.reused_tokens if parent else 0,
        "reuse": reuse_note,
        "parent_seconds": parent_seconds,
        "parent_check_seconds": check_seconds,  # proving the parent (a spot check: its prefill)
        "load_seconds": round(load_seconds, 4),
    }
    if REFUSED_PARENT in reuse_note:  # a parent failed its spot check: the CLI warns
        report_extra["parent_warning"] = reuse_note
    made = (parent, inherited)
    manifest, report = _write(job, loaded, cut, cache, stats, tmp, needed, made, report_extra)
    # the builder never ships what the one validator refuses; the cache file's bytes were hashed
    # as read back from disk by write_cache (the memo keys that read by the file's stat), so the
    # self-check does not read and hash ~1 GB a second time
    began = time.perf_counter()
    announce(job.progress, "self-check (the one validator)")
    validate(tmp, job.identity, trust_memo=True)
    report["self_check_seconds"] = round(time.perf_counter() - began, 4)  # not in the file
    report["build_seconds"] = round(time.perf_counter() - started, 4)  # every phase, as waited
    if folder_state(job.target.model_dir) != job.state:  # a load read other bytes than hashed
        raise ModelError(
            f"{changed_message(job.target.model_dir, 'during the build')}: nothing was written; "
            "build again once the folder is settled"
        )
    return manifest, report


def announce(progress: Progress | None, phase: str) -> None:
    """Tell the progress display a long phase after the prefill has begun (a quantized bundle's
    fidelity check can take longer than its prefill: silence there read as a hang)."""
    phase_of = getattr(progress, "phase", None)  # progress displays may have none (library use)
    if phase_of is not None:
        phase_of(phase)


def _stable_cut(job: Job, tokenizer: Any) -> StableCut:
    return stable_cut(job.target.definition, job.target.model_dir, job.rendered, tokenizer)


def stable_cut(
    d: LoadedDefinition, model_dir: Path, rendered: Rendered, tokenizer: Any
) -> StableCut:
    """The bundle's ids: the pinned template as the builder renders it (mlx_lm.server's path), or
    the definition's servers' own request code (PipelineError when too few are stable)."""
    if d.spec.servers:
        return server_cut(d, model_dir, rendered)
    rerender = lambda msgs: render_prefix(d, model_dir, messages=msgs).text  # noqa: E731
    ids_of = lambda msgs: encode(tokenizer, rerender(msgs))  # noqa: E731
    base = encode(tokenizer, rendered.text)
    return stable_prefix(base, d.messages, ids_of, tokenizer.decode)


def _resume(job: Job, loaded, tokens: list[int], bundles_root: Path) -> tuple[Resume | None, str]:
    """Where the prefill starts: a parent's stored cache at the shared token, or token 0 (and
    why)."""
    if job.reuse is False:
        return None, "incremental builds off (--full)"
    wanted = Wanted(
        tokens, job.identity, job.builder, dtype_name(loaded.compute_dtype),
        job.target.definition.spec.cache.prefill_step_size,
        layout=layout_for(job.builder.mlx_lm) or DEFAULT_LAYOUT, model=loaded.model,
        trusted_keys=job.trusted_keys, parent_check=job.parent_check,
        stored_dtype=dtype_name(loaded.serving_dtype),
        kv_bits=job.target.definition.spec.cache.kv_bits,
        writes=(job.target.definition.name, job.target.definition.version),
    )  # fmt: skip
    explicit = job.reuse if isinstance(job.reuse, Path) else None
    return find_parent(bundles_root, wanted, job.dest, explicit)


def _write(
    job: Job, loaded, cut: StableCut, cache, stats, tmp: Path, needed: int,
    made: tuple[ParentInfo | None, InheritedCheck | None], report_extra: dict[str, Any],
) -> tuple[Manifest, dict[str, Any]]:  # fmt: skip
    """The cache file, the fidelity record, then manifest and sums, holding as little as can be:
    the prefill's buffers go as the exact-size reference is made, the quantized copy once
    written, the reference once the checks have run from it."""
    d, opts = job.target.definition, job.target.definition.spec.cache
    parent, inherited = made
    reference = finalize_cache(cache, loaded.serving_dtype)
    del cache
    final = (
        quantize_cache(reference, opts.kv_bits, opts.kv_group_size) if opts.kv_bits else reference
    )
    layers = CacheSummary([type(c).__name__ for c in final], cache_nbytes(final))
    # "model" and "tokenizer_config" let `mlx_lm.generate --prompt-cache-file` read the file too
    metadata = {"model": job.target.model_ref, "tokenizer_config": "{}"}
    report = {
        "prefill_seconds": round(stats.seconds, 4),
        "tokens_per_second": round(stats.tokens_per_second, 2),
        "peak_memory_bytes": stats.peak_memory_bytes,
        "blas": blas_status().notice,
        **report_extra,
    }
    try:
        # the read-back compared the file's tensors with `final`: for full precision, the reference
        exact = final is reference
        began = time.perf_counter()
        digests = write_cache(tmp, final, cut.tokens, metadata)
        report["write_seconds"] = round(time.perf_counter() - began, 4)  # save, read back
        held = [reference]
        del final, reference
        fidelity = FidelityInfo(checked=False)
        began = time.perf_counter()
        if job.check:
            announce(
                job.progress, f"fidelity check (warm vs cold, {d.spec.check.greedy_tokens} tokens)"
            )
            fidelity = run_checks(
                loaded, job.target.model_dir, held, tmp / CACHE_FILE, cut.tokens,
                cut.probe_tokens, d.spec, continued=parent is not None,
                read_back_equal=exact, progress=job.progress,
            )  # fmt: skip
            if parent is not None:  # its reference run started from the parent too: say so
                fidelity = continued_reference(fidelity, parent, inherited)
        held.clear()
        report["check_seconds"] = round(time.perf_counter() - began, 4)
        facts = BuildFacts(
            job.identity, job.rendered, cut, layers, dtype_name(loaded.serving_dtype),
            job.builder, job.key, digests, parent, block_record(tmp / CACHE_FILE, len(cut.tokens)),
        )  # fmt: skip
        manifest = make_manifest(job.target, facts, fidelity)
        report["peak_rss_bytes"] = peak_rss_bytes()
        write_bundle_files(tmp, manifest, digests, report=report)
    except (OSError, RuntimeError) as exc:  # mlx's writer raises RuntimeError when it cannot write
        why = write_failure(exc)
        if why is None:
            raise
        raise BuildError(
            f"cannot write {job.dest}: {why} (needs about {needed / 2**20:,.0f} MiB); nothing was "
            "published, any earlier bundle there is kept; free space there, raise the file size "
            "limit (ulimit -f) or pass --bundles DIR on another disk"
        ) from None
    return manifest, report


@dataclass(frozen=True)
class CacheSummary:
    """What the manifest records of the cache layers."""

    classes: list[str]
    nbytes: int


def check_room(bundles_root: Path, needed: int) -> None:
    """Refuse before the prefill when the bundles folder's filesystem cannot hold the bundle."""
    free = free_bytes(bundles_root)
    if free < needed * 1.05 + (1 << 20):
        raise BuildError(
            f"cannot write {bundles_root}: No space left on device (needs about "
            f"{needed / 2**20:,.0f} MiB, {free / 2**20:,.0f} MiB free); free some space or pass --bundles"
        )


@dataclass(frozen=True)
class BuildFacts:
    """What a build established, from which the manifest is made."""

    identity: ModelIdentity
    rendered: Rendered
    cut: StableCut
    cache: CacheSummary
    dtype: str
    builder: BuilderInfo
    key: str
    digests: FileDigests
    parent: ParentInfo | None
    blocks: BlocksInfo | None = None  # cache.blocks (format 5)


def make_manifest(target: Target, facts: BuildFacts, fidelity: FidelityInfo) -> Manifest:
    """The bundle's manifest (deterministic: no timings, no paths, no timestamps)."""
    d, text, opts = target.definition, facts.rendered.text, target.definition.spec.cache
    return Manifest(
        format_version=FORMAT_VERSION,
        kind="prefix",
        prefix=PrefixInfo(name=d.name, version=d.version, content_sha256=d.content_sha256),
        text=TextInfo(sha256=sha256_bytes(text.encode()), chars=len(text), preview=preview(text)),
        tokens=TokenInfo(
            count=len(facts.cut.tokens),
            ids_sha256=token_ids_sha256(facts.cut.tokens),
            rendered_tokens=facts.cut.rendered_tokens,
            stable_tokens=len(facts.cut.tokens),
        ),
        model=ModelInfo(
            slug=target.slug,
            fingerprint=facts.identity.model,
            tokenizer_fingerprint=facts.identity.tokenizer,
            template_sha256=facts.rendered.template_sha256,
            template_source=facts.rendered.template_source,
            template_date=d.spec.template.date.isoformat() if d.spec.template.date else None,
        ),
        cache=CacheInfo(
            classes=facts.cache.classes,
            dtype=facts.dtype,
            kv_bits=opts.kv_bits,
            kv_group_size=opts.kv_group_size,
            prefill_step_size=opts.prefill_step_size,
            nbytes=facts.cache.nbytes,
            file_sha256=facts.digests.sha256,
            file_blake3=facts.digests.blake3,
            file_bytes=facts.digests.size,
            layout=layout_for(facts.builder.mlx_lm),
            blocks=facts.blocks,
        ),
        builder=facts.builder,
        fidelity=fidelity,
        build_key=facts.key,
        parent=facts.parent,
        request=request_info(d),
    )


def token_ids_sha256(tokens: list[int]) -> str:
    """sha256 of the token ids as compact JSON (how the manifest and runtime compare them)."""
    return sha256_bytes(canonical_json(tokens))


def peak_rss_bytes() -> int:
    """Peak resident memory of this process."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
