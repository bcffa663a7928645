"""Reaching the Hugging Face hub quickly or not at all: offline mode and a short reachability probe.

huggingface_hub retries a failed request five times with backoff (about 25 s) before it gives up.
Build, push and pull call `require_hub` first: with HF_HUB_OFFLINE set it fails at once, and an
unreachable endpoint fails after one probe (PROBE_SECONDS at most, DNS included), each as one
PipelineError line saying what was being done and what to do.
"""

from __future__ import annotations

import os
import threading

from pipeline.format.errors import PipelineError

PROBE_SECONDS = 3.0
_TRUE = {"1", "on", "yes", "true"}


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now, or as huggingface_hub read it at import."""
    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    if env.strip().lower() in _TRUE:
        return True
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_endpoint() -> str:
    """The hub URL huggingface_hub talks to (HF_ENDPOINT, default https://huggingface.co)."""
    from huggingface_hub import constants

    return str(constants.ENDPOINT).rstrip("/")


def probe(endpoint: str, timeout: float) -> str | None:
    """None when one request to the endpoint gets any HTTP answer, else why not (one try, no retry)."""
    outcome: list[str | None] = [f"no answer within {timeout:.0f} s"]

    def attempt() -> None:
        try:
            from huggingface_hub.utils import get_session

            get_session().head(endpoint, timeout=timeout)  # no redirects followed (httpx, requests)
            outcome[0] = None
        except Exception as exc:  # any transport failure means the same: not reachable now
            detail = " ".join(str(exc).split())[:120]
            outcome[0] = f"{exc.__class__.__name__}: {detail}" if detail else exc.__class__.__name__

    worker = threading.Thread(target=attempt, daemon=True)  # bounds a DNS lookup that hangs
    worker.start()
    worker.join(timeout + 0.5)
    return outcome[0]


def require_hub(doing: str, fix: str, error: type[PipelineError] = PipelineError) -> None:
    """Fail fast, as one line, when the hub cannot be reached: `<doing>: why; <fix>`."""
    if hub_offline():
        raise error(f"{doing}: HF_HUB_OFFLINE is set; {fix}")
    endpoint = hub_endpoint()
    problem = probe(endpoint, PROBE_SECONDS)
    if problem is not None:
        raise error(f"{doing}: cannot reach {endpoint} ({problem}); {fix}")
