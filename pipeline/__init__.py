"""Prefix-cache bundles for MLX: build KV caches for stable prompt prefixes, mount them at startup."""

from pipeline.blas import ensure_fast_blas

# Must run before anything imports mlx: the mlx-cpu wheel's own BLAS is ~40x slower than OpenBLAS.
BLAS_STATUS = ensure_fast_blas()

__version__ = "0.1.0"
