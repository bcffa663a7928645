"""The thin runtime loader a server imports: validate, mount, prompt-cache manager, serve.

Imports pipeline.format only: never pipeline.build, never jinja2 (tests/test_layout.py guards it).
"""

from pipeline.format.errors import BundleError, PipelineError
from pipeline.runtime.mount import (
    MountedBundle,
    MountResult,
    Refusal,
    find_bundles,
    identity_for,
    model_bundles,
    model_bundles_dir,
    mount,
    verify,
)
from pipeline.runtime.prompt_cache import CacheHit, PromptCacheManager

__all__ = [
    "BundleError",
    "CacheHit",
    "MountResult",
    "MountedBundle",
    "PipelineError",
    "PromptCacheManager",
    "Refusal",
    "find_bundles",
    "identity_for",
    "model_bundles",
    "model_bundles_dir",
    "mount",
    "verify",
]
