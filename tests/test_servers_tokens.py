"""Tokenization parity per server (pipeline.runtime.servers.tokens): each server's own way of turning
a chat request into ids, checked against a bundle's ids with a tokenizer that has a BOS token and a
template that writes it (a copy of the tiny model's tokenizer: `<|endoftext|>` as BOS)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.runtime.servers.tokens import SERVER_NAMES, parity, request_ids

from conftest import SYSTEM, TOOLS

ROOT = Path(__file__).resolve().parents[1]
BOS = "<|endoftext|>"
PREFIX = [{"role": "system", "content": SYSTEM}]
REQUEST = [*PREFIX, {"role": "user", "content": "Where is my order 12345?"}]


@pytest.fixture(scope="module")
def bos_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a tokenizer that adds BOS (post-processor) and a template writing it."""
    out = tmp_path_factory.mktemp("bos") / "tiny-bos"
    shutil.copytree(tiny_model, out)
    tok = json.loads((out / "tokenizer.json").read_text())
    bos_id = next(t["id"] for t in tok["added_tokens"] if t["content"] == BOS)
    first = [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": first,
        "pair": [*first, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {BOS: {"id": BOS, "ids": [bos_id], "tokens": [BOS]}},
    }
    (out / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.update(bos_token=BOS, add_bos_token=True)
    config["chat_template"] = "{{- bos_token }}" + config["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def tokenizer(model: Path):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(model)


def bundle_ids(tok) -> list[int]:
    """A bundle's ids as the builder makes them: the template's own tokenization of the prefix."""
    return list(tok.apply_chat_template(PREFIX, tools=TOOLS, add_generation_prompt=False))


def test_without_a_bos_every_server_sees_the_bundles_ids(tiny_model: Path):
    tok = tokenizer(tiny_model)
    ids = bundle_ids(tok)
    for server in SERVER_NAMES:
        p = parity(server, tok, ids)
        assert (p.reusable, p.total, p.reason) == (len(ids), len(ids), None)
        assert request_ids(server, tok, REQUEST, TOOLS)[: len(ids)] == ids


def test_a_template_writing_bos_doubles_it_on_omni_and_mlx_openai_server(bos_model: Path):
    tok = tokenizer(bos_model)
    ids = bundle_ids(tok)
    bos = tok.convert_tokens_to_ids(BOS)
    assert ids[0] == bos and ids[1] != bos
    for server in ("mlx-lm", "vllm-mlx"):  # both avoid a second BOS
        p = parity(server, tok, ids)
        assert (p.reusable, p.total, p.reason) == (len(ids), len(ids), None)
        assert request_ids(server, tok, REQUEST, TOOLS)[:2] == [bos, ids[1]]
    for server in ("mlx-omni-server", "mlx-openai-server"):
        p = parity(server, tok, ids)
        assert (p.reusable, p.total) == (1, len(ids))
        assert (
            p.reason == f"{server} adds '{BOS}' before the prefix (the tokenizer's special tokens)"
        )
        assert request_ids(server, tok, REQUEST, TOOLS)[:3] == [bos, bos, ids[1]]


@pytest.mark.parametrize("server", SERVER_NAMES)
def test_match_tokenizes_as_the_named_server(server: str, bos_model: Path, tmp_path: Path):
    args = [sys.executable, str(ROOT / "build.py"), "--bundles", str(tmp_path), "match"]
    args += ["--model", str(bos_model), "--server", server, "--messages", json.dumps(REQUEST)]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=120)
    tok = tokenizer(bos_model)
    expected = len(request_ids(server, tok, REQUEST, None))
    named = "" if server == "mlx-lm" else f" ({server})"
    assert proc.stdout.splitlines()[0] == f"request: {expected} tokens{named}"
