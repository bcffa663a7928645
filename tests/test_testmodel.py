"""The generated test model: deterministic bytes, loadable by mlx_lm and transformers offline."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import mlx.core as mx  # conftest imported pipeline first, so OpenBLAS is already loaded
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from pipeline.format.errors import ModelError
from pipeline.testmodels.model import FILES, generate_model, main, model_config, tensor_shapes

TEXTS = [
    "Hello, world!",
    "  two leading spaces,\ttabs\n\nand blank lines\r\n",
    "café naïve Grüße 日本語 東京 Привет مرحبا",
    "emoji 😀🚀 and a family 👩‍👩‍👧 and flags 🇫🇷",
    'def f(x):\n    return {"a": [1, 2.5e-3, null]}\n',
    "\x00\x01 control bytes, zero\u200bwidth, 0123456789",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": '{"temp": 20}'},
]
RENDERED = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",'
    ' "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call><|im_end|>\n"
    '<|im_start|>user\n<tool_response>\n{"temp": 20}\n</tool_response><|im_end|>\n'
    "<|im_start|>assistant\n"
)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: _sha256(p) for p in sorted(folder.iterdir())}


def test_regeneration_in_another_process_is_byte_identical(tiny_model: Path, tmp_path: Path):
    out = tmp_path / "again"
    cmd = [
        sys.executable,
        "-m",
        "pipeline.testmodels.model",
        "--size",
        "tiny",
        "--seed",
        "0",
        str(out),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert result.stdout == f"{out}\n"
    assert sorted(_digests(out)) == sorted([*FILES, "generator.json"])
    assert _digests(out) == _digests(tiny_model)


def test_existing_model_is_reused_untouched(tiny_model: Path):
    before = {p.name: p.stat().st_mtime_ns for p in tiny_model.iterdir()}
    assert generate_model(tiny_model) == tiny_model
    assert {p.name: p.stat().st_mtime_ns for p in tiny_model.iterdir()} == before


def test_existing_folder_of_another_model_is_refused(tiny_model: Path):
    with pytest.raises(ModelError) as err:
        generate_model(tiny_model, seed=1)
    assert str(err.value) == (
        f"cannot generate the test model into {tiny_model}: it exists and is not the model "
        "size=tiny seed=1 dtype=float32; delete it or choose another folder"
    )


def test_cli_reports_errors_in_one_line(tiny_model: Path, capsys: pytest.CaptureFixture):
    with pytest.raises(SystemExit) as exit_:
        main(["--seed", "1", str(tiny_model)])
    assert exit_.value.code == 1
    assert capsys.readouterr().err.startswith(
        f"Error: cannot generate the test model into {tiny_model}"
    )


@pytest.mark.parametrize(
    ("size", "seed", "dtype", "error"),
    [
        ("huge", 0, None, "unknown test model size 'huge'; choose one of tiny, small, bench"),
        ("tiny", 0, "int8", "unknown dtype 'int8'; choose one of float32, bfloat16, float16"),
        ("tiny", -1, None, "seed must be a non-negative integer, got -1"),
    ],
)
def test_invalid_parameters_are_refused(tmp_path: Path, size, seed, dtype, error):
    with pytest.raises(ModelError) as err:
        generate_model(tmp_path / "m", size, seed=seed, dtype=dtype)
    assert str(err.value) == error
    assert not (tmp_path / "m").exists()


def test_mlx_lm_loads_it_and_runs_a_forward_pass(tiny_model: Path):
    model, tokenizer = load(str(tiny_model))
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer.get_vocab()) == 1024
    assert tokenizer.eos_token_ids == {config["eos_token_id"], config["bos_token_id"]}
    logits = model(mx.arange(500)[None])
    assert logits.shape == (1, 500, 1024)
    assert bool(mx.all(mx.isfinite(logits)))


def test_greedy_generation_is_not_degenerate(tiny_model: Path):
    model, tokenizer = load(str(tiny_model))
    messages = [{"role": "user", "content": "Write a haiku about caches."}]
    prompt = mx.array(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    tokens = [int(token) for token, _ in generate_step(prompt, model, max_tokens=16)]
    assert len(tokens) == 16
    assert len(set(tokens)) >= 8, tokens


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_any_text(tiny_model: Path, text: str):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    raw = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    ids = tokenizer.encode(text)
    assert ids == raw.encode(text).ids  # transformers uses tokenizer.json as written; no BOS
    assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids_after_the_merges(tiny_model: Path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    config = json.loads((tiny_model / "config.json").read_text())
    special = "<|endoftext|><|im_start|><|im_end|>"
    markup = "<think></think><tool_call></tool_call><tool_response></tool_response>"
    assert tokenizer.encode(special + markup) == list(range(1015, 1024))
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", config["eos_token_id"])
    assert (tokenizer.pad_token, tokenizer.bos_token) == ("<|endoftext|>", None)
    assert tokenizer.decode(tokenizer.encode(special + markup), skip_special_tokens=True) == markup


def test_chat_template_renders_tools_and_tool_calls(tiny_model: Path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rendered = tokenizer.apply_chat_template(
        MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert rendered == RENDERED


def test_chat_template_without_tools_and_thinking_disabled(tiny_model: Path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rendered = tokenizer.apply_chat_template(
        MESSAGES[:2], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_another_seed_changes_only_the_weights(tiny_model: Path, tiny_model_other_weights: Path):
    ours, other = _digests(tiny_model), _digests(tiny_model_other_weights)
    assert {k for k in ours if ours[k] != other[k]} == {"generator.json", "model.safetensors"}
    a = mx.load(str(tiny_model / "model.safetensors"))
    b = mx.load(str(tiny_model_other_weights / "model.safetensors"))
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    assert not mx.array_equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_weights_match_mlx_casting(tiny_model: Path, tmp_path: Path, dtype: str):
    half = generate_model(tmp_path / dtype, dtype=dtype)
    config = json.loads((half / "config.json").read_text())
    assert (config["dtype"], config["torch_dtype"]) == (dtype, dtype)
    full = mx.load(str(tiny_model / "model.safetensors"))
    for name, value in mx.load(str(half / "model.safetensors")).items():
        assert value.dtype == getattr(mx, dtype)
        assert mx.array_equal(value, full[name].astype(value.dtype)), name


def test_bench_config_has_qwen3_0_6b_shapes():
    config = model_config("bench", 8192)
    shapes = tensor_shapes(config)
    assert (config["dtype"], config["vocab_size"], config["eos_token_id"]) == (
        "bfloat16",
        151936,
        8185,
    )
    assert len(shapes) == 2 + 28 * 11
    assert shapes["model.layers.27.self_attn.q_proj.weight"] == (2048, 1024)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (1024, 3072)
    assert sum(math.prod(s) for s in shapes.values()) == 596_049_920
    assert model_config("bench", 8192, "float32")["torch_dtype"] == "float32"
