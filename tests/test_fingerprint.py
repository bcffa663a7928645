"""Fingerprints: weights hashed in full, memoised by stat, and re-hashed when a file changes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from pipeline.format.fingerprint import model_fingerprint, model_identity, tokenizer_fingerprint


def test_weights_edited_in_place_change_the_fingerprint(
    tmp_path: Path, tiny_model: Path, monkeypatch
):
    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "memo"))
    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    before = model_fingerprint(model)
    assert model_fingerprint(model) == before  # second call served from the memo
    memo = json.loads((tmp_path / "memo" / "sha256-memo.json").read_text())
    assert list(memo) == [
        f"{(model / 'model.safetensors').resolve()}|" + list(memo)[0].split("|", 1)[1]
    ]
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01  # same size, one bit of one weight
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(1, 1))  # a different mtime, as any real write gives
    assert model_fingerprint(model) != before


def test_template_is_not_part_of_the_tokenizer_fingerprint(tmp_path: Path, tiny_model: Path):
    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    before = model_identity(model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] += " "
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    after = model_identity(model)
    assert after.tokenizer == before.tokenizer == tokenizer_fingerprint(tiny_model)
    assert after.template != before.template and after.model == before.model


def test_chat_template_jinja_file_wins(tmp_path: Path, tiny_model: Path):
    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert model_identity(model).template != model_identity(tiny_model).template
