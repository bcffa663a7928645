"""Prefix-cache bundles for MLX: build KV caches for stable prompt prefixes, mount them at startup.

Importing any part of `pipeline` only imports. On Linux, an entry point calls
`pipeline.blas.ensure_fast_blas(argv)` first so mlx gets a system OpenBLAS (see pipeline/blas.py).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
