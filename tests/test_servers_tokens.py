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

from pipeline.format.errors import PipelineError
from pipeline.runtime.servers.tokens import (
    model_type,
    parity,
    request_body,
    request_code_servers,
    request_ids,
)

from conftest import SYSTEM, TOOLS

SERVER_NAMES = request_code_servers()  # the servers whose own request code serve can call

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


IDS_WORKER = """
import json, sys
from pathlib import Path
from mlx_lm.utils import load_tokenizer
from pipeline.runtime.servers.tokens import request_body, request_code_servers, model_type, request_ids
model, messages, tools = Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
tok = load_tokenizer(model)
body = request_body(messages, tools, {})
print(json.dumps({s: request_ids(s, tok, body, model_type(model)) for s in request_code_servers()}))
"""


def server_ids(model: Path, tools: list[dict] | None = TOOLS) -> dict[str, list[int]]:
    """{server: the ids its own request code gives REQUEST with `tools`}, in the server venv."""
    from servers_env import servers_python

    args = [str(servers_python()), "-c", IDS_WORKER, str(model), json.dumps(REQUEST)]
    proc = subprocess.run([*args, json.dumps(tools)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_without_a_bos_every_server_re_encodes_the_bundles_ids(tiny_model: Path):
    tok = tokenizer(tiny_model)
    ids = bundle_ids(tok)
    for server in SERVER_NAMES:
        p = parity(server, tok, ids)
        assert (p.reusable, p.total, p.reason) == (len(ids), len(ids), None)
    body = request_body(REQUEST, TOOLS, {})
    assert request_ids("mlx-lm", tok, body, model_type(tiny_model))[: len(ids)] == ids


@pytest.mark.slow
def test_each_servers_own_request_code_sees_the_bundles_ids(tiny_model: Path):
    ids = bundle_ids(tokenizer(tiny_model))
    for server, theirs in server_ids(tiny_model).items():
        assert theirs[: len(ids)] == ids, server


def test_a_template_writing_bos_doubles_it_when_re_encoded_by_omni_and_mlx_openai_server(
    bos_model: Path,
):
    tok = tokenizer(bos_model)
    ids = bundle_ids(tok)
    bos = tok.convert_tokens_to_ids(BOS)
    assert ids[0] == bos and ids[1] != bos
    for server in ("mlx-lm", "vllm-mlx"):  # both avoid a second BOS
        p = parity(server, tok, ids)
        assert (p.reusable, p.total, p.reason) == (len(ids), len(ids), None)
    for server in ("mlx-omni-server", "mlx-openai-server"):
        p = parity(server, tok, ids)
        assert (p.reusable, p.total) == (1, len(ids))
        assert (
            p.reason == f"{server} adds '{BOS}' before the prefix (the tokenizer's special tokens)"
        )


@pytest.mark.slow
def test_a_template_writing_bos_doubles_it_in_omni_and_mlx_openai_servers_own_code(
    bos_model: Path,
):
    tok = tokenizer(bos_model)
    ids = bundle_ids(tok)
    bos = tok.convert_tokens_to_ids(BOS)
    theirs = server_ids(bos_model)
    for server in ("mlx-lm", "vllm-mlx"):
        assert theirs[server][:2] == [bos, ids[1]], server
    for server in ("mlx-omni-server", "mlx-openai-server"):
        assert theirs[server][:3] == [bos, bos, ids[1]], server


def test_a_server_that_is_not_installed_is_named(tiny_model: Path):
    import importlib.util

    if importlib.util.find_spec("vllm_mlx") is not None:
        pytest.skip("vllm-mlx is installed in this environment")
    body = request_body(REQUEST, TOOLS, {})
    with pytest.raises(PipelineError, match="vllm-mlx is not installed in this Python environment"):
        request_ids("vllm-mlx", tokenizer(tiny_model), body, model_type(tiny_model))


def match_first_line(python: Path | str, model: Path, server: str, bundles: Path) -> str:
    args = [str(python), str(ROOT / "build.py"), "--bundles", str(bundles), "match"]
    args += ["--model", str(model), "--server", server, "--messages", json.dumps(REQUEST)]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=300)
    return (proc.stdout.splitlines() or [proc.stderr])[0]


def test_match_tokenizes_as_mlx_lm_server(bos_model: Path, tmp_path: Path):
    tok = tokenizer(bos_model)
    expected = len(request_ids("mlx-lm", tok, request_body(REQUEST, None, {}), "qwen3"))
    line = match_first_line(sys.executable, bos_model, "mlx-lm", tmp_path)
    assert line == f"request: {expected} tokens"


@pytest.mark.slow
def test_match_tokenizes_as_the_named_server(bos_model: Path, tmp_path: Path):
    from concurrent.futures import ThreadPoolExecutor

    from servers_env import servers_python

    servers = SERVER_NAMES[1:]
    with ThreadPoolExecutor(len(servers) + 1) as pool:  # separate processes: side by side
        expected = pool.submit(server_ids, bos_model, None)
        lines = pool.map(
            lambda s: match_first_line(servers_python(), bos_model, s, tmp_path), servers
        )
        for server, line in zip(servers, lines, strict=True):
            assert line == f"request: {len(expected.result()[server])} tokens ({server})"
