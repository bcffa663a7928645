"""Warm-equals-cold check: continuing from the bundle as written must match the in-memory cache."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache

from pipeline.builder.definition import PrefixDefinition
from pipeline.builder.prefill import LoadedModel, Progress, dtype_name, load_model
from pipeline.format.errors import BuildError
from pipeline.format.manifest import FidelityInfo, ReuseCheck, ServingCheck
from pipeline.runtime import fork_cache, lossy_min_tokens

# Default bounds on the max |logit difference| (see README "Fidelity"): exact for full precision.
DEFAULT_THRESHOLDS = {None: 0.0, 8: 0.5, 4: 2.0}


def threshold_for(spec: PrefixDefinition) -> float:
    """The definition's bound, or the default for its kv_bits."""
    if spec.check.max_abs_logit_diff is not None:
        return spec.check.max_abs_logit_diff
    return DEFAULT_THRESHOLDS[spec.cache.kv_bits]


def continue_from(
    loaded: LoadedModel,
    cache: list[Any],
    probe: list[int],
    steps: int,
    progress: Progress | None = None,
) -> tuple[mx.array, list[int]]:
    """Next-token logits after `probe`, and `steps` greedy tokens, from a copy of `cache`."""
    cache = fork_cache(cache)  # the caller's caches stay untouched; one copy, at the first write
    # chunked as a server prefills a request (a shortest-reuse tail is thousands of tokens: one
    # call over a quantized cache took ~25 s on CPU, and nothing could show its progress)
    began, last = time.perf_counter(), len(probe) - 1
    for start in range(0, last, SERVER_CHUNK):
        loaded.model(mx.array(probe[start : min(start + SERVER_CHUNK, last)])[None], cache=cache)
        mx.eval([c.state for c in cache])
        if progress is not None:
            progress(min(start + SERVER_CHUNK, last), last, time.perf_counter() - began, 0)
    logits = loaded.model(mx.array(probe[-1:])[None], cache=cache)[0, -1].astype(mx.float32)
    first = logits
    tokens = []
    for _ in range(steps):
        token = int(mx.argmax(logits).item())
        tokens.append(token)
        logits = loaded.model(mx.array([[token]]), cache=cache)[0, -1].astype(mx.float32)
    return first, tokens


def run_checks(
    loaded: LoadedModel,
    model_dir: Path,
    held: list[list[Any]],
    written_path: Path,
    tokens: list[int],
    probe: list[int],
    spec: PrefixDefinition,
    continued: bool = False,
    read_back_equal: bool = False,
    progress: Progress | None = None,
) -> FidelityInfo:
    """The fidelity record: the bundle as written against the builder's in-memory cache (raises
    beyond the bound), and against the serving path (recorded, never a refusal).

    read_back_equal: the written file's tensors were read back byte-identical to held[0] (a full-
    precision bundle: pipeline.builder.readback), which proves warm equals the builder's cache
    exactly, so no model run repeats that proof (exact_checks).

    continued: the in-memory cache continued a parent's stored KV, so it is no cold prefill; the
    serving comparison then costs a cold prefill from token 0 and runs only when the definition
    asks for it (check.serving = true); otherwise the child inherits its parent's (incremental).

    held: [the builder's reference cache], taken out and dropped once its runs are done, before
    the written file is loaded: at most one bundle-sized cache and one working copy coexist with
    the model (builder peak memory, bench case 5).
    """
    if not probe:
        raise BuildError("fidelity check needs at least one probe token after the prefix")
    if read_back_equal:
        return exact_checks(loaded, model_dir, held, tokens, probe, spec, continued, progress)
    steps = spec.check.greedy_tokens
    reference = held.pop()
    ref = continue_from(loaded, reference, probe, steps)
    short = shortest_reuse(reference, tokens, probe, spec)
    short_ref = (
        continue_from(loaded, short.cut(reference), short.tail, steps, progress) if short else None
    )
    plan = serving_plan(loaded, spec, continued)
    # where the serving path is the builder's path, the reference is that cold prefill already
    cold = ref if plan.runs and plan.same_path else None
    del reference
    written = load_prompt_cache(str(written_path))
    got = continue_from(loaded, written, probe, steps)
    info = fidelity_info(loaded, spec, probe, ref, got, continued)
    if short is not None:
        short_got = continue_from(loaded, short.cut(written), short.tail, steps, progress)
        info = info.model_copy(update={"shortest_reuse": short.record(short_ref, short_got)})
    if not plan.runs:
        return info.model_copy(update={"serving_skipped": plan.skipped})
    try:
        serving = serving_model(loaded, model_dir, plan)
        warm = got if plan.same_dtype else continue_from(serving, written, probe, steps)
        del written
        if cold is None:
            cold_cache = _server_prefill(serving.model, tokens, progress)
            cold = continue_from(serving, cold_cache, probe, steps)
    except (RuntimeError, ValueError) as exc:  # e.g. MLX's CPU gather_mm is float32-only (MoE)
        return serving_failed(info, exc)
    return info.model_copy(update={"serving": serving_check(loaded, plan, cold, warm)})


BYTE_PROOF = (
    "none run: the written K/V were read back byte-identical to the builder's in-memory cache, "
    "so warm from the bundle equals it exactly (every logit, every greedy token)"
)


def exact_checks(
    loaded: LoadedModel, model_dir: Path, held: list[list[Any]], tokens: list[int],
    probe: list[int], spec: PrefixDefinition, continued: bool = False,
    progress: Progress | None = None,
) -> FidelityInfo:  # fmt: skip
    """The record of a bundle whose bytes are the builder's cache: difference 0 by that proof;
    the serving comparison, where it runs, warm from those bytes (the probe's logits only when
    the serving path is the builder's own: then it is the same proof)."""
    reference = held.pop()
    info = FidelityInfo(
        checked=True, max_abs_logit_diff=0.0, threshold=threshold_for(spec), greedy_match=True,
        probe=f"{len(probe)} tokens; {BYTE_PROOF}",
        reference=builder_reference(loaded, spec.cache.prefill_step_size, continued),
    )  # fmt: skip
    plan = serving_plan(loaded, spec, continued)
    if not plan.runs:
        return info.model_copy(update={"serving_skipped": plan.skipped})
    steps = spec.check.greedy_tokens
    try:
        serving = serving_model(loaded, model_dir, plan)
        if plan.same_path:  # the cold prefill is the builder's: the same proof, plus the margin
            return _same_path(loaded, plan, info, first_logits(serving, reference, probe))
        warm = continue_from(serving, reference, probe, steps)
        del reference
        cold = continue_from(
            serving, _server_prefill(serving.model, tokens, progress), probe, steps
        )
    except (RuntimeError, ValueError) as exc:  # e.g. MLX's CPU gather_mm is float32-only (MoE)
        return serving_failed(info, exc)
    return info.model_copy(update={"serving": serving_check(loaded, plan, cold, warm)})


def serving_failed(info: FidelityInfo, exc: Exception) -> FidelityInfo:
    """The record when the serving path cannot run on this builder: why, on one line."""
    detail = " ".join(str(exc).split())[:160]
    skipped = f"failed: the serving path cannot run on this builder ({detail})"
    return info.model_copy(update={"serving_skipped": skipped})


def _same_path(
    loaded: LoadedModel, plan: ServingPlan, info: FidelityInfo, logits: mx.array
) -> FidelityInfo:
    """The record where the serving path's cold prefill is the builder's own (whose bytes the
    bundle holds): difference 0, the probe's top-2 margin measured."""
    margin = top2_margin(logits)
    tie = margin <= 0.0
    check = ServingCheck(
        dtype=dtype_name(loaded.serving_dtype), device=mx.default_device().type.name,
        chunk_tokens=SERVER_CHUNK, same_as_builder=plan.same_path, max_abs_logit_diff=0.0,
        greedy_match=True, top2_margin=margin, tie_within_tolerance=tie,
    )  # fmt: skip
    update = {"top2_margin": margin, "tie_within_tolerance": tie, "serving": check}
    return info.model_copy(update=update)


def first_logits(loaded: LoadedModel, cache: list[Any], probe: list[int]) -> mx.array:
    """Next-token logits after `probe`, from a copy of `cache`."""
    cache = fork_cache(cache)
    return loaded.model(mx.array(probe)[None], cache=cache)[0, -1].astype(mx.float32)


Run = tuple[mx.array, list[int]]  # next-token logits after the probe, greedy tokens after it


@dataclass(frozen=True)
class ShortReuse:
    """A request taking only the fewest tokens the runtime lets a lossy bundle serve."""

    keep: int
    trim: int
    tail: list[int]  # the rest of the prefix, then the probe

    def cut(self, cache: list[Any]) -> list[Any]:
        return fork_cache(cache, self.trim)

    def record(self, ref: Run, got: Run) -> ReuseCheck:
        diff = float(mx.max(mx.abs(ref[0] - got[0])).item())
        return ReuseCheck(tokens=self.keep, max_abs_logit_diff=diff, greedy_match=ref[1] == got[1])


def shortest_reuse(
    reference: list[Any], tokens: list[int], probe: list[int], spec: PrefixDefinition
) -> ShortReuse | None:
    """For a quantized bundle whose layers all trim, the shortest reuse the runtime allows (None
    otherwise: a cache that cannot trim is only ever reused whole, which the main check covers)."""
    if spec.cache.kv_bits is None or not all(c.is_trimmable() for c in reference):
        return None
    keep = lossy_min_tokens(len(tokens))
    if keep >= len(tokens):
        return None
    return ShortReuse(keep, len(tokens) - keep, [*tokens[keep:], *probe])


def fidelity_info(
    loaded: LoadedModel, spec: PrefixDefinition, probe: list[int], ref: Run, got: Run,
    continued: bool = False,
) -> FidelityInfo:  # fmt: skip
    """Compare the run from the written bundle with the builder's own; raise beyond the bound."""
    (ref_logits, ref_tokens), (got_logits, got_tokens) = ref, got
    diff = float(mx.max(mx.abs(ref_logits - got_logits)).item())
    margin = top2_margin(ref_logits)
    bound = threshold_for(spec)
    info = FidelityInfo(
        checked=True,
        max_abs_logit_diff=diff,
        threshold=bound,
        greedy_tokens=spec.check.greedy_tokens,
        greedy_match=ref_tokens == got_tokens,
        probe=f"{len(probe)} tokens",
        reference=builder_reference(loaded, spec.cache.prefill_step_size, continued),
        top2_margin=margin,
        tie_within_tolerance=margin <= diff,
    )
    exact = spec.cache.kv_bits is None
    if diff > bound or (exact and not info.greedy_match):
        raise BuildError(
            f"{spec.name}: warm-from-bundle differs from the in-memory prefill "
            f"(max |logit diff| {diff:.4g} > bound {bound:g}, greedy match {info.greedy_match}); "
            "raise check.max_abs_logit_diff if this quantization error is acceptable"
        )
    return info


SERVER_CHUNK = 2048  # mlx_lm.server's default --prefill-step-size


def builder_reference(loaded: LoadedModel, step: int, continued: bool = False) -> str:
    """The builder's path, as the manifest names it (a child's continues a parent: the record's
    note names which, at which token)."""
    return (
        f"builder {'continuation' if continued else 'cold prefill'}: "
        f"{dtype_name(loaded.compute_dtype)} compute on "
        f"{mx.default_device().type.name}, chunks of {step} tokens, KV stored as "
        f"{dtype_name(loaded.serving_dtype)}"
    )


@dataclass(frozen=True)
class ServingPlan:
    """Whether and how the serving-path comparison runs."""

    runs: bool
    skipped: str | None  # why not, when it does not run
    same_dtype: bool  # the builder computes in the serving dtype: same model object
    same_path: bool  # ... and chunks as mlx_lm.server does: the builder's prefill is the cold one


CONTINUED_SKIP = (
    "skipped: a child continues its parent's stored KV, so comparing it with a cold prefill "
    "costs one from token 0; fidelity.inherited holds the comparison its parent's positions "
    "carry; set check.serving = true to run it"
)


def serving_plan(
    loaded: LoadedModel, spec: PrefixDefinition, continued: bool = False
) -> ServingPlan:
    same = loaded.compute_dtype == loaded.serving_dtype
    # a continued child's prefill is not a cold one, whatever its chunks
    same_path = same and spec.cache.prefill_step_size == SERVER_CHUNK and not continued
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    if spec.check.serving is False:
        return ServingPlan(False, "disabled by check.serving = false", same, same_path)
    if spec.check.serving is None and continued:
        return ServingPlan(False, CONTINUED_SKIP, same, same_path)
    if spec.check.serving is None and on_cpu and not same:
        why = (
            f"skipped: a {dtype_name(loaded.serving_dtype)} prefill on CPU is slow; "
            "set check.serving = true to run it"
        )
        return ServingPlan(False, why, same, same_path)
    return ServingPlan(True, None, same, same_path)


def serving_model(loaded: LoadedModel, model_dir: Path, plan: ServingPlan) -> LoadedModel:
    """The model as a server computes with it: in its own dtype."""
    model = loaded.model if plan.same_dtype else load_model(model_dir, "model").model
    return LoadedModel(model, loaded.tokenizer, loaded.serving_dtype, loaded.serving_dtype)


def serving_check(loaded: LoadedModel, plan: ServingPlan, cold: Run, warm: Run) -> ServingCheck:
    (cold_logits, cold_tokens), (warm_logits, warm_tokens) = cold, warm
    diff = float(mx.max(mx.abs(cold_logits - warm_logits)).item())
    margin = top2_margin(cold_logits)
    return ServingCheck(
        dtype=dtype_name(loaded.serving_dtype),
        device=mx.default_device().type.name,
        chunk_tokens=SERVER_CHUNK,
        same_as_builder=plan.same_path,
        max_abs_logit_diff=diff,
        greedy_match=cold_tokens == warm_tokens,
        top2_margin=margin,
        tie_within_tolerance=margin <= diff,
    )


def _server_prefill(model: Any, tokens: list[int], progress: Progress | None) -> list[Any]:
    """A cold prefill chunked as mlx_lm.server chunks a prompt (the check's longest step: shown
    on the build's progress display, as the builder's prefill is)."""
    cache, began = make_prompt_cache(model), time.perf_counter()
    for start in range(0, len(tokens), SERVER_CHUNK):
        model(mx.array(tokens[start : start + SERVER_CHUNK])[None], cache=cache)
        mx.eval([c.state for c in cache])
        if progress is not None:
            done = min(start + SERVER_CHUNK, len(tokens))
            progress(done, len(tokens), time.perf_counter() - began, 0)
    return cache


def top2_margin(logits: mx.array) -> float:
    """The gap between the two largest logits: below the measured difference, greedy is a toss-up."""
    top2 = mx.sort(logits)[-2:]
    return float((top2[1] - top2[0]).item())
