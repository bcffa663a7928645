"""How long the rest of a chunked prefill will take: later chunks cost more (attention).

A chunk of n tokens ending at position `end` costs about a·n·(1 + end/c): the layers' matmuls cost
the same for every token, while each token's attention reads every position before it (MLX's CPU
attention scores the whole n × end rectangle, then masks it). `c`, the crossover, is the position
where a token's attention costs as much as the rest of its layer. A prior for c comes from the
model's config.json (measured on this project's test models, see CROSSOVER_PER_FLOP); each chunk
done then refines a and c, the prior kept as a weight against the noise of one chunk's timing.
A rate measured on the first chunks alone (tokens done / seconds) underestimated a 9.8k-token
build by 4x: its first chunk costs a fifth of its last.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

# c = CROSSOVER_PER_FLOP * P / (2 * H * d) + CROSSOVER_FLOOR, P a layer's weights and H * d its
# attention width: P / (2 * H * d) is the crossover counted in FLOPs. MLX's CPU attention costs
# several times more per FLOP than the BLAS matmuls (its softmax and mask are plain passes over
# the n x end scores): chunks timed at 2k-17k positions here gave c ~ 200-250 for the "small"
# test model (FLOP-counted 1,536) and ~180-480 for Qwen3-0.6B's shapes (3,840), both under load.
CROSSOVER_PER_FLOP = 0.125
CROSSOVER_FLOOR = 128.0
# Without a config: Qwen3-0.6B's shapes, as above.
DEFAULT_CROSSOVER = 608.0
# How far (in ln c) the chunks may pull c from its prior: a factor e costs as much as a chunk
# whose time the fit misses by sqrt(PRIOR_WEIGHT), about 14 %.
PRIOR_WEIGHT = 0.02
GRID = [2 ** (k / 8) for k in range(-48, 49)]  # c / prior from 1/64 to 64


@dataclass(frozen=True)
class Chunk:
    """One prefilled chunk: positions [start, end) and the seconds it took."""

    start: int
    end: int
    seconds: float


def chunk_work(start: int, end: int, crossover: float) -> float:
    """Work of prefilling positions [start, end) in one chunk, in tokens at position 0."""
    return (end - start) * (1.0 + end / crossover)


def span_work(start: int, end: int, step: int, crossover: float) -> float:
    """Work of prefilling [start, end) in chunks of `step`."""
    edges = [*range(start, end, max(step, 1)), end]
    return sum(chunk_work(a, b, crossover) for a, b in zip(edges, edges[1:], strict=False))


def crossover_from_config(config: dict) -> float:
    """The prior crossover for a model's config.json (DEFAULT_CROSSOVER where a size is missing)."""
    try:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        kv_heads = int(config.get("num_key_value_heads") or heads)
        inner = int(config.get("moe_intermediate_size") or config["intermediate_size"])
        experts = int(config.get("num_experts_per_tok") or 1)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return DEFAULT_CROSSOVER
    width = heads * head_dim
    weights = hidden * (2 * width + 2 * kv_heads * head_dim) + 3 * hidden * inner * experts
    if width <= 0 or weights <= 0:
        return DEFAULT_CROSSOVER
    return CROSSOVER_PER_FLOP * weights / (2 * width) + CROSSOVER_FLOOR


def crossover_for_model(model_dir: Path | None) -> float:
    """The prior crossover for a model folder (its config.json), or DEFAULT_CROSSOVER."""
    if model_dir is None:
        return DEFAULT_CROSSOVER
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return DEFAULT_CROSSOVER
    return crossover_from_config(config if isinstance(config, dict) else {})


@dataclass
class PrefillEta:
    """Chunks as they finish, and the seconds the rest will take."""

    prior: float = DEFAULT_CROSSOVER
    chunks: list[Chunk] = field(default_factory=list)
    _done: int | None = None
    _elapsed: float = 0.0

    def update(self, done: int, elapsed: float) -> None:
        """A progress call: `done` tokens in the cache after `elapsed` seconds of prefill."""
        if self._done is not None and done > self._done and elapsed > self._elapsed:
            self.chunks.append(Chunk(self._done, done, elapsed - self._elapsed))
        if self._done is None or done >= self._done:
            self._done, self._elapsed = done, elapsed

    def remaining(self, total: int) -> float | None:
        """Seconds until `total` tokens are in the cache; None before the first chunk."""
        if not self.chunks or self._done is None:
            return None
        scale, crossover = self.fit()
        step = max(c.end - c.start for c in self.chunks)
        return scale * span_work(self._done, total, step, crossover)

    def fit(self) -> tuple[float, float]:
        """(seconds per unit of work, crossover) that best explain the chunks, the prior kept."""
        best = None
        for factor in GRID:
            c = self.prior * factor
            works = [chunk_work(k.start, k.end, c) / k.seconds for k in self.chunks]
            scale = sum(works) / sum(w * w for w in works)  # least squares on relative error
            misfit = sum((1 - scale * w) ** 2 for w in works)
            cost = misfit + PRIOR_WEIGHT * math.log(factor) ** 2
            if best is None or cost < best[0] - 1e-15:
                best = (cost, scale, c)
        return best[1], best[2]
