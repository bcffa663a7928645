"""Fingerprints of what a KV cache depends on: weights + config, tokenizer, chat template.

Runtime-safe: stdlib only. Weight files are hashed in full once and memoised (pipeline.format.memo),
so server startups after the first cost a stat per file.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.format import memo
from pipeline.format.errors import ModelError
from pipeline.format.regular_files import FileProblem, read_regular

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "tiktoken.model",
)
# At least one of these must be present: they hold the vocabulary (tokenizer_config.json does not).
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
MAX_CONFIG_BYTES = 16 << 20
MAX_TOKENIZER_BYTES = 512 << 20
CHUNK = 8 << 20


@dataclass(frozen=True)
class ModelShape:
    """What the served model's config says a KV cache for it must look like."""

    layers: int
    kv_heads: int | None
    head_dim: int | None
    vocab_size: int | None
    max_positions: int | None
    sliding_window: int | None
    # the class of each layer's cache as the model builds it (runtime.identity derives it from the
    # architecture's own code); None where unknown: the layer count above still applies
    cache_classes: tuple[str, ...] | None = None
    # config.json as canonical JSON, from which every layer's exact state is derived
    # (pipeline.format.cache_state); None where only the recorded identity is known
    config_json: str | None = None


@dataclass(frozen=True)
class ModelIdentity:
    """What a bundle must match in the model folder it is mounted next to."""

    model: str  # sha256 over config.json and every weight file's sha256
    tokenizer: str  # sha256 over tokenizer files (chat template excluded)
    template: str | None  # sha256 of the chat template text the model ships, if any
    shape: ModelShape


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of bytes."""
    return hashlib.sha256(data).hexdigest()


def canonical_json(value: object) -> bytes:
    """Deterministic JSON bytes: sorted keys, compact separators, UTF-8."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


def sha256_text(text: str) -> str:
    """Hex sha256 of UTF-8 text (how template pins are computed)."""
    return sha256_bytes(text.encode("utf-8"))


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class FileDigests:
    """A file's size and digests, from one read."""

    sha256: str
    blake3: str
    size: int


def file_digests(path: Path) -> FileDigests:
    """sha256 and BLAKE3 of a file in one pass (the cache file's pins in the manifest)."""
    from blake3 import blake3

    sha, b3, size = hashlib.sha256(), blake3(max_threads=blake3.AUTO), 0
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            sha.update(chunk)
            b3.update(chunk)
            size += len(chunk)
    return FileDigests(sha.hexdigest(), b3.hexdigest(), size)


def sha256_file_memo(path: Path) -> str:
    """sha256 of a large file, memoised by its stat so unchanged files are not re-read."""
    key = memo.stat_key(path)
    digest = memo.lookup(key)
    if digest is None:
        digest = sha256_file(Path(key.split("|", 1)[0]))
        memo.store(key, digest)
    return digest


def weight_files(model_dir: Path) -> list[Path]:
    """The model's weight files (*.safetensors), sorted."""
    return sorted(p for p in Path(model_dir).glob("*.safetensors") if p.is_file())


def folder_state(model_dir: Path) -> tuple[str, ...]:
    """What the fingerprints read, as the filesystem reports it: every link on the way to the
    folder and to each file (config.json, the weights, the tokenizer and template files), by its
    own inode and ctime, and the stat key (pipeline.format.memo) of what each file resolves to.
    The same state later means none was replaced, edited, added or removed, and no link was
    flipped (a link flipped back is a new link), so a load in between read these bytes. Not seen:
    the whole folder renamed aside and back (its files keep their keys)."""
    folder = Path(model_dir).absolute()
    names = ("config.json", "chat_template.jinja", *TOKENIZER_FILES)
    paths = [folder / n for n in names] + weight_files(folder)
    state = [_links(folder)]
    for path in paths:
        try:
            st = os.lstat(path)
            link = f"{st.st_ino}:{st.st_ctime_ns}|" if stat.S_ISLNK(st.st_mode) else ""
            state.append(link + memo.stat_key(path))
        except OSError:
            state.append(f"{path}|absent")
    return tuple(state)


def _links(path: Path) -> str:
    """Each symbolic link among the components of an absolute path, by inode and ctime."""
    found = []
    for part in [*reversed(path.parents), path]:
        try:
            st = os.lstat(part)
        except OSError:
            return f"{part}|absent"
        if stat.S_ISLNK(st.st_mode):
            found.append(f"{part}@{st.st_ino}:{st.st_ctime_ns}")
    return "|".join(found)


def check_model_folder(model_dir: Path) -> None:
    """ModelError naming the --model folder when it does not exist or is not a folder."""
    if not Path(model_dir).is_dir():
        what = "is not a folder" if Path(model_dir).exists() else "does not exist"
        raise ModelError(
            f"model folder {model_dir} {what}; point --model at an MLX model folder "
            "(config.json, *.safetensors, tokenizer files)"
        )


def _read_model_file(model_dir: Path, name: str, limit: int) -> bytes | None:
    """A model folder file's bytes, None when absent; ModelError when it is not a readable file."""
    check_model_folder(model_dir)  # a missing folder is named as such, not as a missing file
    path = Path(model_dir) / name
    if not path.exists() and not path.is_symlink():
        return None
    try:
        return read_regular(path, limit)
    except FileProblem as exc:
        raise ModelError(f"model {model_dir}: {name} {exc}; fix or replace the file") from None


def _json_object(model_dir: Path, name: str, data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ModelError(f"model {model_dir}: {name} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ModelError(f"model {model_dir}: {name} must hold a JSON object")
    return value


def model_config(model_dir: Path) -> dict[str, Any]:
    """config.json as a dict; ModelError when missing or malformed."""
    data = _read_model_file(model_dir, "config.json", MAX_CONFIG_BYTES)
    if data is None:
        raise ModelError(f"model {model_dir}: no config.json; point --model at an MLX model folder")
    return _json_object(model_dir, "config.json", data)


def model_shape(config: dict[str, Any]) -> ModelShape:
    """Cache-relevant sizes from a config (nested text_config for multimodal models)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}

    def get(*names: str) -> int | None:
        for source in (config, text):
            for name in names:
                value = source.get(name)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
        return None

    heads = get("num_attention_heads")
    hidden = get("hidden_size")
    head_dim = get("head_dim") or (hidden // heads if hidden and heads else None)
    return ModelShape(
        layers=get("num_hidden_layers", "n_layer", "num_layers") or 0,
        kv_heads=get("num_key_value_heads") or heads,
        head_dim=head_dim,
        vocab_size=get("vocab_size"),
        max_positions=get("max_position_embeddings", "max_seq_len", "n_positions"),
        sliding_window=get("sliding_window"),
    )


def model_fingerprint(model_dir: Path) -> str:
    """sha256 over config.json (canonical JSON) and each weight file's name and sha256."""
    cfg = model_config(model_dir)
    weights = weight_files(model_dir)
    if not weights:
        raise ModelError(
            f"model {model_dir}: no *.safetensors weights; point --model at an MLX model folder"
        )
    parts = {
        "config": sha256_bytes(json.dumps(cfg, sort_keys=True).encode()),
        "weights": {p.name: sha256_file_memo(p) for p in weights},
    }
    return sha256_bytes(json.dumps(parts, sort_keys=True).encode())


def tokenizer_fingerprint(model_dir: Path) -> str:
    """sha256 over the tokenizer files; the chat template is left out (it is pinned on its own)."""
    parts: dict[str, str] = {}
    for name in TOKENIZER_FILES:
        data = _read_model_file(model_dir, name, MAX_TOKENIZER_BYTES)
        if data is None:
            continue
        if name == "tokenizer_config.json":
            cfg = _json_object(model_dir, name, data)
            cfg.pop("chat_template", None)
            data = json.dumps(cfg, sort_keys=True).encode()
        parts[name] = sha256_bytes(data)
    if not any(name in parts for name in VOCABULARY_FILES):
        raise ModelError(
            f"model {model_dir}: no tokenizer vocabulary ({', '.join(VOCABULARY_FILES)}); "
            "copy the model's tokenizer files into the folder"
        )
    return sha256_bytes(json.dumps(parts, sort_keys=True).encode())


def model_chat_template(model_dir: Path) -> str | None:
    """The chat template the model folder ships: chat_template.jinja, else tokenizer_config.json."""
    jinja = _read_model_file(model_dir, "chat_template.jinja", MAX_CONFIG_BYTES)
    if jinja is not None:
        try:
            return jinja.decode("utf-8")
        except UnicodeDecodeError:
            raise ModelError(f"model {model_dir}: chat_template.jinja is not UTF-8") from None
    data = _read_model_file(model_dir, "tokenizer_config.json", MAX_TOKENIZER_BYTES)
    if data is None:
        return None
    template = _json_object(model_dir, "tokenizer_config.json", data).get("chat_template")
    if isinstance(template, list):  # named templates: the "default" one is what servers use
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def model_identity(model_dir: Path, template_override: str | None = None) -> ModelIdentity:
    """Fingerprint a model folder as a server would serve it."""
    template = (
        template_override if template_override is not None else model_chat_template(model_dir)
    )
    return ModelIdentity(
        model=model_fingerprint(model_dir),
        tokenizer=tokenizer_fingerprint(model_dir),
        template=sha256_text(template) if template is not None else None,
        shape=model_shape(model_config(model_dir)),
    )
