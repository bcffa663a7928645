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


def test_readme_library_snippet_hits_a_bundle(shop_bundle: Path, tiny_model: Path, tmp_path):
    """The README's snippet, run as written in a project folder holding what it names: its
    request opens with the bundle's system prompt and tools, so it reuses the bundle (the old
    snippet, a user message alone, reused 1 token) and says how many tokens came from it."""
    import re
    import shutil
    import subprocess

    readme = (EXAMPLE.parents[1] / "README.md").read_text(encoding="utf-8")
    snippet = re.search(r"## In your own server\n\n```python\n(.*?)```", readme, re.S).group(1)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "demo-tiny").symlink_to(tiny_model)
    folder = tmp_path / "prefixes" / "support-agent"
    folder.mkdir(parents=True)
    (folder / "system.md").write_text(SYSTEM, encoding="utf-8")
    (folder / "tools.json").write_text(json.dumps(TOOLS), encoding="utf-8")
    shutil.copytree(shop_bundle, tmp_path / "bundles" / "shop" / "1" / shop_bundle.name)
    env = {"PYTHONPATH": str(EXAMPLE.parents[1])}
    proc = subprocess.run(
        [sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True,
        timeout=300, env={**__import__("os").environ, **env},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    prefix = json.loads((shop_bundle / MANIFEST_FILE).read_text())["tokens"]["count"]
    assert re.search(rf"^{prefix} of \d+ prompt tokens came from the bundle$", proc.stdout, re.M)
