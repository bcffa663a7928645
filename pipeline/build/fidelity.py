"""Warm-equals-cold check: continuing from the bundle as written must match the in-memory cache."""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx

from pipeline.build.definition import PrefixDefinition
from pipeline.build.prefill import LoadedModel
from pipeline.format.errors import BuildError
from pipeline.format.manifest import FidelityInfo

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
    cache = copy.deepcopy(cache)  # build time only: the caller's caches stay untouched
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
    bound = threshold_for(spec)
    info = FidelityInfo(
        checked=True,
        max_abs_logit_diff=diff,
        threshold=bound,
        greedy_tokens=steps,
        greedy_match=ref_tokens == got_tokens,
        probe=f"{len(probe)} tokens",
    )
    exact = spec.cache.kv_bits is None
    if diff > bound or (exact and not info.greedy_match):
        raise BuildError(
            f"{spec.name}: warm-from-bundle differs from the in-memory prefill "
            f"(max |logit diff| {diff:.4g} > bound {bound:g}, greedy match {info.greedy_match}); "
            "raise check.max_abs_logit_diff if this quantization error is acceptable"
        )
    return info
