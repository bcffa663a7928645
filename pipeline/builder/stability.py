"""Prefix stability proof: the bundle's tokens must be a prefix of every prompt that continues it.

Templates and BPE tokenizers can merge text across the prefix boundary (a prefix ending in a
space followed by a user turn, say). Render the prefix followed by probe turns, tokenize each,
and cut the bundle at the longest token boundary all of them share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.format.errors import BuildError, PipelineError

# First characters that commonly change tokenization at a boundary.
USER_PROBES = (
    "Hello, can you help me?",
    " leading space",
    "\nleading newline",
    "?! punctuation first",
    "42 starts with a digit",
    "日本語とcafé",
)
ASSISTANT_PROBE = "Sure."
MIN_STABLE_TOKENS = 8

TokensOf = Callable[[list[dict[str, Any]]], list[int]]  # a conversation's ids (generation prompt)
Decoder = Callable[[list[int]], str]


@dataclass(frozen=True)
class StableCut:
    """The bundle's tokens and what the proof found."""

    tokens: list[int]
    rendered_tokens: int
    probes_checked: int
    probe_tokens: list[int]  # the first probe's tokens after the cut (a ready fidelity probe)


def probe_conversations(messages: list[dict[str, str]]) -> list[list[dict[str, str]]]:
    """The prefix followed by each probe turn."""
    convs = [[*messages, {"role": "user", "content": p}] for p in USER_PROBES]
    convs.append([*messages, {"role": "assistant", "content": ASSISTANT_PROBE}])
    return convs


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """Number of leading tokens two sequences share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def stable_prefix(
    base: list[int], messages: list[dict[str, Any]], ids_of: TokensOf, decode: Decoder
) -> StableCut:
    """Cut the prefix's ids `base` at the longest boundary shared by every probe conversation's
    ids (`ids_of`: the builder's rendering, or a server's own request code)."""
    stable, checked, first_probe = len(base), 0, None
    for conv in probe_conversations(messages):
        try:
            probe = ids_of(conv)
        except PipelineError:
            continue  # the template refuses this turn order (e.g. assistant after system)
        checked += 1
        stable = min(stable, common_prefix_length(base, probe))
        first_probe = first_probe or probe
    if checked == 0:
        raise BuildError(
            "no probe turn could be rendered after the prefix; the template refuses every continuation"
        )
    if stable == 0:
        raise BuildError(
            f"no token boundary is shared by the prefix and its continuations: the prefix "
            f"renders as {decode(base)[-60:]!r} at its end but a continuation begins "
            f"{decode(first_probe)[:60]!r}; make the prefix end at a turn boundary"
        )
    if stable < MIN_STABLE_TOKENS:
        raise BuildError(
            f"only {stable} token(s) of the prefix are stable before any continuation (at least "
            f"{MIN_STABLE_TOKENS} are needed for a useful bundle); the template or tokenizer "
            "rewrites the prefix when a turn follows it: make the prefix end at a turn boundary"
        )
    return StableCut(base[:stable], len(base), checked, first_probe[stable:])
