"""The served model's identity: its fingerprints and the cache classes its architecture builds,
the classes remembered by their exact inputs.

Which cache class each layer gets is asked of mlx-lm, and importing mlx-lm imports transformers:
1.5-3 s of a pull, a verify or an inspect that otherwise never touch mlx-lm. The answer is a
function of config.json, the installed mlx-lm's code and our own model builder, so it is kept in
a private table (beside pipeline.format.memo's) under a key over all of them: the config's
canonical JSON, the Python, mlx and mlx-lm versions, and the stat identity (size, mtime_ns,
ctime_ns, inode, device) of every source file of mlx-lm and of cache_state.py. Any change to one
of them is a new key, and the answer is asked of mlx-lm again. Every caller (mount, serve,
verify, inspect, match, the builder, pull) computes the identity here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from pipeline.format import cache_state, memo
from pipeline.format.errors import ModelError, PipelineError, path_argument
from pipeline.format.fingerprint import (
    ModelIdentity,
    canonical_json,
    folder_state,
    model_config,
    model_identity,
)

TABLE = "cache-classes-memo.json"
KEY_SCHEMA = "cache-classes/1"
# a JSON list of class names, or null (an architecture this mlx-lm cannot build)
VALUE = re.compile(r'^(null|\[[A-Za-z0-9_", ]*\])\Z')


def identity_for(model_dir: Path, chat_template: str | None = None) -> ModelIdentity:
    """Fingerprints of the served model, and the cache classes its architecture builds (from the
    memo when their inputs are unchanged); pass the server's template override if it has one."""
    model_dir = path_argument(model_dir, "identity_for: model_dir")
    if chat_template is not None and not isinstance(chat_template, str):
        raise PipelineError(
            f"identity_for: chat_template must be text, got {type(chat_template).__name__}"
        )
    identity = model_identity(model_dir, chat_template)
    config = model_config(model_dir)
    shape = dataclasses.replace(
        identity.shape,
        cache_classes=cache_classes(config),
        config_json=canonical_json(config).decode(),
    )
    return dataclasses.replace(identity, shape=shape)


def settled_identity(
    model_dir: Path, chat_template: str | None = None
) -> tuple[ModelIdentity, tuple[str, ...]]:
    """identity_for, and the folder state it was read in (fingerprint.folder_state), for a caller
    that loads the model after: the same state after the load proves the load read the bytes the
    identity is of. ModelError when a file the fingerprints read changed while they were read."""
    before = folder_state(Path(model_dir))
    identity = identity_for(model_dir, chat_template)
    if folder_state(Path(model_dir)) != before:
        raise ModelError(
            f"{changed_message(model_dir, 'while it was fingerprinted')}; run it again once the "
            "folder is settled"
        )
    return identity, before


def changed_message(model_dir: Path, when: str) -> str:
    """The one line for a model folder whose files changed under a reader."""
    return (
        f"model folder {model_dir}: a file the fingerprints read (config, weights, tokenizer or "
        f"template, or a link to one) was replaced, edited or relinked {when}"
    )


def cache_classes(config: dict[str, Any]) -> tuple[str, ...] | None:
    """pipeline.format.cache_state.model_cache_classes(config), remembered by its inputs."""
    key = inputs_key(config)
    if key is not None:
        found = _parse(memo.load_table(table_path(), VALUE).get(key))
        if found is not False:
            return found
    classes = cache_state.model_cache_classes(config)
    if key is not None:
        text = json.dumps(None if classes is None else list(classes))
        if VALUE.match(text):
            memo.update_table(table_path(), lambda t: {**t, key: text}, VALUE)
    return classes


def _parse(text: str | None) -> tuple[str, ...] | None | bool:
    """The remembered answer, or False when there is none (or it does not parse)."""
    try:
        value = json.loads(text) if text is not None else False
    except ValueError:
        return False
    if value is None:
        return None
    if isinstance(value, list) and all(isinstance(x, str) for x in value):
        return tuple(value)
    return False


def table_path() -> Path:
    return memo.memo_path().with_name(TABLE)


def inputs_key(config: dict[str, Any]) -> str | None:
    """A digest over everything the cache classes depend on; None when mlx-lm's source files
    cannot be listed (then it is always asked)."""
    try:
        spec = importlib.util.find_spec("mlx_lm")  # finds the package without importing it
        roots = list(spec.submodule_search_locations or ()) if spec else []
        versions = [metadata.version("mlx-lm"), metadata.version("mlx")]
    except (ImportError, ValueError, metadata.PackageNotFoundError):
        return None
    if not roots:
        return None
    h = hashlib.sha256()
    for part in (KEY_SCHEMA, sys.version, *versions, canonical_json(config).decode()):
        h.update(part.encode() + b"\0")
    try:
        h.update(_stat(Path(cache_state.__file__), Path(cache_state.__file__).parent))
        for root in roots:
            for path in sorted(Path(root).rglob("*.py")):
                h.update(_stat(path, Path(root)))
    except OSError:
        return None
    return f"{KEY_SCHEMA}|{h.hexdigest()}"


def _stat(path: Path, root: Path) -> bytes:
    numbers = memo.file_identity(os.stat(path))
    return f"{path.relative_to(root)}|{'|'.join(map(str, numbers))}\0".encode()
