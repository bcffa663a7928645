"""Warm-equals-cold check: continuing from the bundle as written must match the in-memory cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from pipeline.build.definition import PrefixDefinition
from pipeline.build.prefill import LoadedModel, dtype_name, load_model
from pipeline.format.errors import BuildError
from pipeline.format.manifest import FidelityInfo, ServingCheck
from pipeline.runtime.prompt_cache import fork_cache

# Default bounds on the max |logit difference| (see README "Fidelity"): exact for full precision.
DEFAULT_THRESHOLDS = {None: 0.0, 8: 0.5, 4: 2.0}


def threshold_for(spec: PrefixDefinition) -> float:
    """The definition's bound, or the default for its kv_bits."""
    if spec.check.max_abs_logit_diff is not None:
        return spec.check.max_abs_logit_diff
    return DEFAULT_THRESHOLDS[spec.cache.kv_bits]


def continue_from(
    loaded: LoadedModel, cache: list[Any], probe: list[int], steps: int
) -> tuple[mx.array, list[int]]:
    """Next-token logits after `probe`, and `steps` greedy tokens, from a copy of `cache`."""
    cache = fork_cache(cache)  # the caller's caches stay untouched; one copy, at the first write
    logits = loaded.model(mx.array(probe)[None], cache=cache)[0, -1].astype(mx.float32)
    first = logits
    tokens = []
    for _ in range(steps):
        token = int(mx.argmax(logits).item())
        tokens.append(token)
        logits = loaded.model(mx.array([[token]]), cache=cache)[0, -1].astype(mx.float32)
    return first, tokens


def check_fidelity(
    loaded: LoadedModel,
    reference: list[Any],
    written: list[Any],
    spec: PrefixDefinition,
    probe: list[int],
) -> FidelityInfo:
    """Compare the bundle as written against the full-precision in-memory cache; raise beyond the bound."""
    if not probe:
        raise BuildError("fidelity check needs at least one probe token after the prefix")
    steps = spec.check.greedy_tokens
    ref_logits, ref_tokens = continue_from(loaded, reference, probe, steps)
    got_logits, got_tokens = continue_from(loaded, written, probe, steps)
    diff = float(mx.max(mx.abs(ref_logits - got_logits)).item())
    margin = top2_margin(ref_logits)
    bound = threshold_for(spec)
    info = FidelityInfo(
        checked=True,
        max_abs_logit_diff=diff,
        threshold=bound,
        greedy_tokens=steps,
        greedy_match=ref_tokens == got_tokens,
        probe=f"{len(probe)} tokens",
        reference=builder_reference(loaded, spec.cache.prefill_step_size),
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


def builder_reference(loaded: LoadedModel, step: int) -> str:
    """The builder's path, as the manifest names it."""
    return (
        f"builder cold prefill: {dtype_name(loaded.compute_dtype)} compute on "
        f"{mx.default_device().type.name}, chunks of {step} tokens, KV stored as "
        f"{dtype_name(loaded.serving_dtype)}"
    )


def check_serving(
    loaded: LoadedModel,
    model_dir: Path,
    caches: tuple[list[Any], list[Any]],
    tokens: list[int],
    probe: list[int],
    spec: PrefixDefinition,
) -> tuple[ServingCheck | None, str | None]:
    """(the serving-path comparison, or None and why it was skipped); recorded, never a refusal.

    caches: (the builder's reference cache, the bundle as written). Where the serving path is the
    builder's path (same dtype, same chunks) the reference is that cold prefill already.
    """
    reference, written = caches
    same = loaded.compute_dtype == loaded.serving_dtype
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    if spec.check.serving is False:
        return None, "disabled by check.serving = false"
    if spec.check.serving is None and on_cpu and not same:
        return None, (
            f"skipped: a {dtype_name(loaded.serving_dtype)} prefill on CPU is slow; "
            "set check.serving = true to run it"
        )
    same_path = same and spec.cache.prefill_step_size == SERVER_CHUNK
    try:
        model = loaded.model if same else load_model(model_dir, "model").model
        serving = LoadedModel(model, loaded.tokenizer, loaded.serving_dtype, loaded.serving_dtype)
        steps = spec.check.greedy_tokens
        cold_cache = reference if same_path else _server_prefill(model, tokens)
        cold_logits, cold_tokens = continue_from(serving, cold_cache, probe, steps)
        warm_logits, warm_tokens = continue_from(serving, written, probe, steps)
    except (RuntimeError, ValueError) as exc:  # e.g. MLX's CPU gather_mm is float32-only (MoE)
        detail = " ".join(str(exc).split())[:160]
        return None, f"failed: the serving path cannot run on this builder ({detail})"
    diff = float(mx.max(mx.abs(cold_logits - warm_logits)).item())
    margin = top2_margin(cold_logits)
    return (
        ServingCheck(
            dtype=dtype_name(loaded.serving_dtype),
            device=mx.default_device().type.name,
            chunk_tokens=SERVER_CHUNK,
            same_as_builder=same_path,
            max_abs_logit_diff=diff,
            greedy_match=cold_tokens == warm_tokens,
            top2_margin=margin,
            tie_within_tolerance=margin <= diff,
        ),
        None,
    )


def _server_prefill(model: Any, tokens: list[int]) -> list[Any]:
    """A cold prefill chunked as mlx_lm.server chunks a prompt."""
    cache = make_prompt_cache(model)
    for start in range(0, len(tokens), SERVER_CHUNK):
        model(mx.array(tokens[start : start + SERVER_CHUNK])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def top2_margin(logits: mx.array) -> float:
    """The gap between the two largest logits: below the measured difference, greedy is a toss-up."""
    top2 = mx.sort(logits)[-2:]
    return float((top2[1] - top2[0]).item())
