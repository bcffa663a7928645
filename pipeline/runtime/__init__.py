"""The thin runtime loader a server imports: validate, mount, prompt-cache manager, serve.

Imports pipeline.format only: never pipeline.builder, never jinja2 (tests/test_import_boundaries.py guards it).
"""

from pipeline.format.errors import BundleError, PipelineError
from pipeline.runtime.mount import (
    MountedBundle,
    MountResult,
    RefusedBundle,
    find_bundles,
    identity_for,
    model_bundles,
    model_bundles_dir,
    mount,
    verify,
)
from pipeline.runtime.prompt_cache import (
    LOSSY_MIN_SHARE,
    CacheHit,
    PromptCacheManager,
    fork_cache,
    lossy_min_tokens,
    preference,
    reusable_tokens,
)

__all__ = [
    # modules the CLI imports from (serve and its options, the admin endpoint's documents)
    "admin",
    "discovery",
    "hugepages",
    "serve",
    "servers",
    "snapshot_store",
    # the library API a server uses
    "LOSSY_MIN_SHARE",
    "BundleError",
    "CacheHit",
    "MountResult",
    "MountedBundle",
    "PipelineError",
    "PromptCacheManager",
    "RefusedBundle",
    "find_bundles",
    "fork_cache",
    "identity_for",
    "lossy_min_tokens",
    "preference",
    "reusable_tokens",
    "model_bundles",
    "model_bundles_dir",
    "mount",
    "verify",
]
