"""The README's library example works as written (examples/custom_server.py)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

from pipeline.format.bundle_folder import MANIFEST_FILE

from conftest import SYSTEM, TOOLS

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_server.py"


def test_custom_server_example_starts_warm_and_reuses_turns(
    shop_bundle: Path, tiny_model: Path, monkeypatch
):
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), str(tiny_model), str(shop_bundle.parents[2])])
    example = runpy.run_path(str(EXAMPLE), run_name="example")
    prefix = json.loads((shop_bundle / MANIFEST_FILE).read_text())["tokens"]["count"]
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is order 9?"}]
    reply, hit = example["answer"](chat, TOOLS)
    assert hit == prefix and reply
    chat += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Thanks"}]
    assert example["answer"](chat, TOOLS)[1] > prefix
    assert example["manager"].stats()["pinned"] == 1
