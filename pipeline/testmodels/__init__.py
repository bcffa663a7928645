"""Deterministic real-format model folders the project generates itself (no hub needed)."""

# Modules the CLI, tests and the bench import from.
__all__ = [
    "arch",
    "model",
    "tokenizer",
]
