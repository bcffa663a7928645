"""The build side: prefix definition -> pinned render -> stability cut -> MLX prefill -> bundle."""

# Modules the CLI, distribute and CI scripts import from; the rest are internal steps.
__all__ = [
    "authoring",
    "batch",
    "builder",
    "definition",
    "demo",
    "model_files",
    "prefill",
    "render",
    "request",
    "retention",
    "server_ids",
    "shards",
    "signing",
    "targets",
    "versioning",
    "writer",
]
