"""Shared pytest fixtures; keep each section small and add new ones under their own heading."""

from __future__ import annotations

from pathlib import Path

import pytest

import pipeline  # noqa: F401  (first: loads OpenBLAS before anything imports mlx)
from pipeline.testmodel import generate_model

# --- Generated test models (pipeline.testmodel) -------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny real-format Qwen3 model folder (seed 0), generated once per test session."""
    return generate_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def tiny_model_other_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tiny model with other weights (seed 1): same shapes, tokenizer and template."""
    return generate_model(tmp_path_factory.mktemp("models") / "tiny-seed1", seed=1)
