"""How each server turns a chat request into token ids, and whether it sees a bundle's ids.

Read from the released servers: mlx_lm.server tokenizes through
`apply_chat_template(tokenize=True)` (no special tokens added); vllm-mlx 0.6.0 renders to text
and encodes it, adding special tokens only when the text does not already start with the BOS
token; mlx-omni-server 0.5.3 and mlx-openai-server 1.8.1 render to text and call
`tokenizer.encode(prompt)`, which adds the tokenizer's special tokens (a second BOS when the
template writes one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SERVER_NAMES = ("mlx-lm", "vllm-mlx", "mlx-omni-server", "mlx-openai-server")


def encode_text(server: str, tokenizer: Any, text: str) -> list[int]:
    """Token ids for rendered text, encoded the way `server` encodes a rendered prompt."""
    if server == "mlx-lm":
        return list(tokenizer.encode(text, add_special_tokens=False))
    if server == "vllm-mlx":
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not text.startswith(bos)
        return list(tokenizer.encode(text, add_special_tokens=add_special))
    return list(tokenizer.encode(text))  # omni, mlx-openai-server: the tokenizer's default


def render(server: str, tokenizer: Any, messages: list[dict], tools: list[dict] | None) -> str:
    """The request's prompt text as `server` renders it (generation prompt added)."""
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
    if server == "vllm-mlx":
        kwargs["enable_thinking"] = True  # vllm-mlx's default unless the model name says coder
    return tokenizer.apply_chat_template(messages, tools=tools, **kwargs)


def request_ids(
    server: str, tokenizer: Any, messages: list[dict], tools: list[dict] | None
) -> list[int]:
    """The token ids `server` computes for a chat request."""
    if server == "mlx-lm":
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
        return list(ids)
    return encode_text(server, tokenizer, render(server, tokenizer, messages, tools))


@dataclass(frozen=True)
class Parity:
    """How many of a bundle's tokens a server's own tokenization of its prefix keeps."""

    reusable: int  # leading bundle tokens the server's ids share
    total: int
    reason: str | None  # None when the server sees exactly the bundle's ids


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def parity(server: str, tokenizer: Any, bundle_ids: Sequence[int]) -> Parity:
    """Re-encode the bundle's prefix text as `server` does and compare with the bundle's ids."""
    ids = [int(t) for t in bundle_ids]
    text = tokenizer.decode(ids, skip_special_tokens=False)
    theirs = encode_text(server, tokenizer, text)
    if theirs[: len(ids)] == ids:
        return Parity(len(ids), len(ids), None)
    at = _common(theirs, ids)
    if len(theirs) > len(ids) and theirs[len(theirs) - len(ids) :] == ids:
        added = tokenizer.decode(theirs[: len(theirs) - len(ids)], skip_special_tokens=False)
        why = f"{server} adds {added!r} before the prefix (the tokenizer's special tokens)"
    else:
        why = (
            f"{server} encodes the prefix text differently from token {at} "
            f"(server {theirs[at : at + 4]}, bundle {ids[at : at + 4]})"
        )
    return Parity(at, len(ids), why)
