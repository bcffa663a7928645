"""Text output keeps one item on one line: a path, a name or a manifest text field holding a
newline, a terminal escape or bytes that are not UTF-8 is shown escaped, never as a line break,
an escape sequence or a UnicodeEncodeError on a strict UTF-8 stdout; --json stays JSON."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.cli.common import one_line
from pipeline.format.bundle_folder import MANIFEST_FILE, SUMS_FILE, sums_text
from pipeline.format.fingerprint import sha256_bytes, sha256_file

from conftest import write_definition

# a folder name forging an `ok` line, clearing the screen, and holding a byte that is not UTF-8
WEIRD = "evil\nok /tmp/forged (shop@9, 999 tokens)\x1b[2J caf\udce9"
FORGED = "\nvalid for /models/prod: yes\x1b[2J"


@pytest.fixture
def weird(tmp_path: Path, tiny_model: Path, shop_bundle: Path) -> Path:
    """A project under a folder named WEIRD holding the shop definition and its bundle."""
    root = tmp_path / WEIRD
    write_definition(root, tiny_model)
    shutil.copytree(shop_bundle, root / "bundles/shop/1" / shop_bundle.name)
    return root


class StrictStdout:
    """stdout as on a host whose locale is UTF-8 (PYTHONIOENCODING=utf-8:strict); set in the
    test itself, since pytest's capture puts its own stdout back between setup and call."""

    def __init__(self, monkeypatch) -> None:
        self.raw = io.BytesIO()
        self.stream = io.TextIOWrapper(self.raw, encoding="utf-8", errors="strict")
        monkeypatch.setattr(sys, "stdout", self.stream)

    def take(self) -> str:
        """What was written since the last take (strict: nothing but UTF-8 was)."""
        self.stream.flush()
        text = self.raw.getvalue().decode("utf-8")
        self.raw.seek(0)
        self.raw.truncate()
        return text


def keypair(folder: Path) -> Path:
    assert main(["keygen", "-W", "--secret-key", str(folder / "k.key")]) == 0
    return folder / "k.key"


def test_verify_shows_a_forged_folder_name_on_its_one_line(weird: Path, tiny_model, monkeypatch):
    stdout = StrictStdout(monkeypatch)
    (bundle,) = (weird / "bundles/shop/1").iterdir()
    assert main(["verify", str(bundle), "--model", str(tiny_model)]) == 0
    tokens = json.loads((bundle / MANIFEST_FILE).read_text())["tokens"]["count"]
    assert stdout.take() == f"ok {one_line(str(bundle))} (shop@1, {tokens} tokens)\n"
    assert "evil\\nok /tmp/forged" in one_line(str(bundle)) and "caf\\udce9" in one_line(
        str(bundle)
    )


@pytest.mark.parametrize("command", ["inspect", "sign", "list", "match", "verify --json"])
def test_every_text_printer_keeps_a_weird_path_on_one_line(
    weird: Path, tiny_model: Path, tmp_path: Path, monkeypatch, command: str
):
    stdout = StrictStdout(monkeypatch)
    (bundle,) = (weird / "bundles/shop/1").iterdir()
    project = ["--prefixes", str(weird / "prefixes"), "--bundles", str(weird / "bundles")]
    argv = {
        "inspect": lambda: ["inspect", str(bundle)],
        "sign": lambda: ["sign", str(bundle), "--key", str(keypair(tmp_path))],
        "list": lambda: [*project, "list"],
        "match": lambda: ["match", "--model", str(tiny_model), "--bundles", str(weird / "bundles"),
                          "--messages", '[{"role": "user", "content": "hi"}]'],
        "verify --json": lambda: ["verify", str(bundle), "--model", str(tiny_model), "--json"],
    }[command]()  # fmt: skip
    stdout.take()  # keygen's lines
    assert main(argv) in (0, 1)  # match: cold is exit 1
    out = stdout.take()
    if command == "verify --json":
        assert json.loads(out)["bundles"][0]["path"] == str(bundle)
        return
    assert all(line.isprintable() for line in out.splitlines()), out
    assert one_line(str(bundle)) in out or one_line(str(weird)) in out, out
    assert not any(line.startswith("ok /tmp/forged") for line in out.splitlines()), out


def test_inspect_shows_manifest_text_fields_escaped(shop_bundle: Path, tmp_path: Path, capsys):
    """Free-text manifest fields (builder.*, fidelity.*, the template source) with a newline and
    a clear-screen escape print neither a forged line nor the escape."""
    bundle = tmp_path / "b"
    shutil.copytree(shop_bundle, bundle)
    m = json.loads((bundle / MANIFEST_FILE).read_text())
    for part, field in [("builder", "device"), ("builder", "kernels"), ("builder", "platform"),
                        ("builder", "pipeline"), ("fidelity", "reference"), ("fidelity", "probe")]:  # fmt: skip
        m[part][field] += FORGED
    data = (json.dumps(m, indent=2, sort_keys=True) + "\n").encode()
    (bundle / MANIFEST_FILE).write_bytes(data)
    digests = {"cache.safetensors": sha256_file(bundle / "cache.safetensors")}
    (bundle / SUMS_FILE).write_text(sums_text({**digests, MANIFEST_FILE: sha256_bytes(data)}))
    assert main(["inspect", str(bundle)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\\x1b[2J" in out
    assert not any(line.startswith("valid for /models/prod") for line in out.splitlines()), out
