"""Fingerprints of what a KV cache depends on: weights + config, tokenizer, chat template.

Runtime-safe: stdlib only. Weight files are hashed in full once and memoised by
(path, size, mtime, inode), so server startups after the first cost a stat per file.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import ModelError

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
CHUNK = 8 << 20
_memo_lock = threading.Lock()


@dataclass(frozen=True)
class ModelIdentity:
    """What a bundle must match in the model folder it is mounted next to."""

    model: str  # sha256 over config.json and every weight file's sha256
    tokenizer: str  # sha256 over tokenizer files (chat template excluded)
    template: str | None  # sha256 of the chat template text the model ships, if any


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


def _memo_path() -> Path:
    base = os.environ.get("PREFIX_BUNDLES_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mlx-prefix-bundles"
    )
    return Path(base) / "sha256-memo.json"


def _load_memo(memo: Path) -> dict:
    try:
        return json.loads(memo.read_text())
    except (OSError, ValueError):
        return {}


def _store_memo(memo: Path, table: dict) -> None:
    try:  # best effort: a read-only home only costs a re-hash next time
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, sort_keys=True))
        os.replace(tmp, memo)
    except OSError:
        pass


def stat_key(path: Path) -> str:
    """Identity of a file's current contents as the filesystem reports it (path, size, mtime, inode)."""
    real = os.path.realpath(path)
    st = os.stat(real)
    return f"{real}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"


def memo_lookup(key: str) -> str | None:
    """The sha256 recorded for a stat key, if any."""
    with _memo_lock:
        return _load_memo(_memo_path()).get(key)


def memo_store(key: str, digest: str) -> None:
    """Record a file's sha256 under its stat key (replacing that file's older states)."""
    real = key.split("|", 1)[0]
    memo = _memo_path()
    with _memo_lock:
        table = _load_memo(memo)
        # forget this file's older states and files that are gone, so the memo stays small
        table = {
            k: v
            for k, v in table.items()
            if not k.startswith(real + "|") and os.path.exists(k.split("|", 1)[0])
        }
        table[key] = digest
        _store_memo(memo, table)


def sha256_file_memo(path: Path) -> str:
    """sha256 of a large file, memoised by its stat so unchanged files are not re-read."""
    key = stat_key(path)
    digest = memo_lookup(key)
    if digest is None:
        digest = sha256_file(Path(key.split("|", 1)[0]))
        memo_store(key, digest)
    return digest


def weight_files(model_dir: Path) -> list[Path]:
    """The model's weight files (*.safetensors), sorted."""
    return sorted(p for p in Path(model_dir).glob("*.safetensors") if p.is_file())


def model_fingerprint(model_dir: Path) -> str:
    """sha256 over config.json (canonical JSON) and each weight file's name and sha256."""
    model_dir = Path(model_dir)
    config = model_dir / "config.json"
    weights = weight_files(model_dir)
    if not config.is_file() or not weights:
        raise ModelError(
            f"model {model_dir}: needs config.json and *.safetensors weights; "
            "point --model at an MLX model folder"
        )
    try:
        cfg = json.loads(config.read_text())
    except ValueError as exc:
        raise ModelError(f"model {model_dir}: config.json is not valid JSON ({exc})") from None
    parts = {
        "config": sha256_bytes(json.dumps(cfg, sort_keys=True).encode()),
        "weights": {p.name: sha256_file_memo(p) for p in weights},
    }
    return sha256_bytes(json.dumps(parts, sort_keys=True).encode())


def tokenizer_fingerprint(model_dir: Path) -> str:
    """sha256 over the tokenizer files; the chat template is left out (it is pinned on its own)."""
    model_dir = Path(model_dir)
    parts: dict[str, str] = {}
    for name in TOKENIZER_FILES:
        path = model_dir / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if name == "tokenizer_config.json":
            cfg = json.loads(data)
            cfg.pop("chat_template", None)
            data = json.dumps(cfg, sort_keys=True).encode()
        parts[name] = sha256_bytes(data)
    if not parts:
        raise ModelError(
            f"model {model_dir}: no tokenizer files found ({', '.join(TOKENIZER_FILES[:2])})"
        )
    return sha256_bytes(json.dumps(parts, sort_keys=True).encode())


def model_chat_template(model_dir: Path) -> str | None:
    """The chat template the model folder ships: chat_template.jinja, else tokenizer_config.json."""
    model_dir = Path(model_dir)
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = model_dir / "tokenizer_config.json"
    if not config.is_file():
        return None
    template = json.loads(config.read_text()).get("chat_template")
    if isinstance(template, list):  # named templates: the "default" one is what servers use
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template


def model_identity(model_dir: Path, template_override: str | None = None) -> ModelIdentity:
    """Fingerprint a model folder as a server would serve it."""
    template = (
        template_override if template_override is not None else model_chat_template(model_dir)
    )
    return ModelIdentity(
        model=model_fingerprint(model_dir),
        tokenizer=tokenizer_fingerprint(model_dir),
        template=sha256_text(template) if template is not None else None,
    )
