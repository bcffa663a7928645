"""A broken model folder: one error line naming the folder and what is broken in it, and the other
definitions are still built."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.cli import main

from conftest import write_definition


def _config(**change):
    def breaks(model: Path) -> None:
        config = json.loads((model / "config.json").read_text())
        config.update(change)
        for key in [k for k, v in change.items() if v is None]:
            del config[key]
        (model / "config.json").write_text(json.dumps(config))

    return breaks


def _write(name: str, text: str):
    return lambda model: (model / name).write_text(text)


def _truncate(model: Path) -> None:
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])


BROKEN = [
    (
        "config without hidden_size",
        _config(hidden_size=None),
        "config.json is broken (TypeError: ModelArgs.__init__() missing 1 required positional "
        "argument: 'hidden_size')",
    ),
    (
        "config with a string for a number",
        _config(num_hidden_layers="two"),
        "config.json is broken (TypeError: 'str' object cannot be interpreted as an integer)",
    ),
    (
        "weights of another shape",
        _config(intermediate_size=48),
        "the weights (model*.safetensors) do not fit config.json (Expected shape (48, 64) but "
        "received shape (128, 64) for parameter model.layers.0.mlp.gate_proj.weight)",
    ),
    (
        "truncated weights",
        _truncate,
        "the weights (model*.safetensors) are broken ([load_safetensors] The JSON header is "
        "{header} bytes long but the file is only 1000 bytes. Perhaps an incomplete download "
        "or corrupt file?)",
    ),
    (
        "tokenizer.json an empty object",
        _write("tokenizer.json", "{}"),
        "the tokenizer files (tokenizer.json, tokenizer_config.json) are broken "
        "(KeyError: 'added_tokens')",
    ),
]


@pytest.mark.parametrize(
    ("breaks", "expected"), [c[1:] for c in BROKEN], ids=[c[0] for c in BROKEN]
)
def test_a_broken_model_is_one_line_and_the_others_are_built(
    tmp_path: Path, tiny_model: Path, capsys, breaks, expected: str
):
    bad = tmp_path / "badmodel"
    shutil.copytree(tiny_model, bad)
    header = int.from_bytes((bad / "model.safetensors").read_bytes()[:8], "little")
    breaks(bad)
    write_definition(tmp_path, tiny_model, "shop", prefill_step_size=16)
    write_definition(tmp_path, bad, "aa-bad", prefill_step_size=16)  # sorts first
    prefixes, bundles = tmp_path / "prefixes", tmp_path / "bundles"
    code = main(["--prefixes", str(prefixes), "--bundles", str(bundles), "build", "--no-check"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1
    assert errors == [
        f"error: aa-bad@1 -> badmodel: model {bad}: {expected.format(header=header)}; fix it or "
        "download the model again",
        "error: 1 of 2 definitions failed (aa-bad); the others were built: fix the errors above "
        "and build again",
    ]
    assert "Traceback" not in err
    assert len(list((bundles / "shop" / "1").iterdir())) == 1
