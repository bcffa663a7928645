"""A model folder read through mlx_lm, a broken file in it named in one ModelError line.

mlx_lm raises whatever its reading of a broken folder hits: TypeError for a config.json field
missing or of the wrong type, KeyError for a tokenizer.json without a section, RuntimeError for
truncated weights. Only mlx_lm's loaders run inside `reading`, so each of those is the folder's
fault, and becomes a ModelError here, at the one boundary where the folder is loaded, with the
exception's own words (a bug of ours never runs inside it).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeline.format.errors import ModelError

# what mlx_lm's loaders raise for a folder whose files are broken
LOAD_ERRORS = (
    OSError,
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    AttributeError,
    RuntimeError,
    RecursionError,
)
CONFIG = "config.json is broken"
WEIGHTS = "the weights (model*.safetensors) are broken"
UNFIT = "the weights (model*.safetensors) do not fit config.json"
TOKENIZER = "the tokenizer files (tokenizer.json, tokenizer_config.json) are broken"


@contextmanager
def reading(model_dir: Path, what: str) -> Iterator[None]:
    """Turn what mlx_lm raises while reading the folder into one ModelError saying `what`."""
    try:
        yield
    except LOAD_ERRORS as exc:
        raise ModelError(broken(model_dir, what, exc)) from exc


def broken(model_dir: Path, what: str, exc: BaseException) -> str:
    """The one line for a model folder: `what` is wrong with it, and the exception's words."""
    plain = isinstance(exc, (OSError, ValueError, RuntimeError)) and str(exc)
    detail = str(exc) if plain else f"{type(exc).__name__}: {exc}"
    return f"model {model_dir}: {what} ({detail}); fix it or download the model again"


def load_weights(model_dir: Path) -> tuple[Any, dict[str, Any]]:
    """mlx_lm's model and config for the folder, the broken file named (ModelError)."""
    from mlx_lm.utils import load_config, load_model

    path = Path(model_dir)
    with reading(model_dir, CONFIG):
        load_config(path)
    default = inspect.signature(load_model).parameters["get_model_classes"].default
    stage = [WEIGHTS]  # until mlx_lm asks for the classes, it is reading the weight files

    def classes(config: dict[str, Any]) -> Any:
        stage[0] = CONFIG  # the weights are read: the model is made from config.json next
        model_class, args_class = default(config=config)

        def make(args: Any) -> Any:
            model = model_class(args)
            stage[0] = UNFIT  # made: what fails next is fitting the weights to it
            return model

        return make, args_class

    try:
        return load_model(path, get_model_classes=classes)
    except LOAD_ERRORS as exc:
        raise ModelError(broken(model_dir, stage[0], exc)) from exc


def load_tokenizer(model_dir: Path, **options: Any) -> Any:
    """mlx_lm's tokenizer for the folder, the broken file named (ModelError)."""
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    with reading(model_dir, TOKENIZER):
        return mlx_load_tokenizer(Path(model_dir), **options)
