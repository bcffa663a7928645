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


def test_a_shared_cache_folder_is_never_chmodded_and_keeps_no_memo(
    tmp_path: Path, tiny_model: Path, monkeypatch
):
    """PREFIX_BUNDLES_CACHE_DIR naming an existing folder open to others (such as /tmp): a read
    command leaves its mode alone and keeps no memo there (before: chmod 700, locking every
    other user out); a folder it creates itself is owner-only."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(shared))
    model_fingerprint(tiny_model)
    assert oct(shared.stat().st_mode & 0o7777) == oct(0o1777) and list(shared.iterdir()) == []
    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "new" / "memo"))
    model_fingerprint(tiny_model)
    assert (tmp_path / "new" / "memo").stat().st_mode & 0o077 == 0
    assert (tmp_path / "new" / "memo" / "sha256-memo.json").is_file()


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


def test_a_config_with_more_layers_than_a_bundle_records_is_refused_unbuilt(tiny_model: Path):
    """10**6 layers would be built (lazily: minutes and tens of GB) before the identity check
    refuses the bundle; past what a manifest records, it is refused before any is built."""
    import pytest

    from pipeline.format.cache_state import lazy_model, model_cache_classes

    config = json.loads((tiny_model / "config.json").read_text())
    for where in ([], ["text_config"]):
        huge = json.loads(json.dumps(config))
        target = huge
        for key in where:
            target = target.setdefault(key, {})
        target["num_hidden_layers"] = 10**6
        with pytest.raises(ValueError, match="num_hidden_layers is 1000000, over the 4096 layers"):
            lazy_model(huge)
        assert model_cache_classes(huge) is None
