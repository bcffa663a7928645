"""pipeline/format/validate.py, the one validator: what it returns, and which stage refuses what.

One case per stage, called directly (verify, inspect, mount and serve all call `validate`). The
same refusals through mount and the CLI: test_refusals.py; hundreds of mutations: test_fuzz.py.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from fuzz_corpus import edit_header, reseal_manifest, reseal_sums

import pipeline.format.validate as validate_module
from pipeline.format.bundle_folder import CACHE_FILE, MANIFEST_FILE, SUMS_FILE
from pipeline.format.errors import BundleError
from pipeline.format.validate import CHECKS, validate
from pipeline.runtime import identity_for


def flip_last_data_byte(bundle: Path) -> None:
    data = bytearray((bundle / CACHE_FILE).read_bytes())
    data[-5] ^= 0x01
    (bundle / CACHE_FILE).write_bytes(bytes(data))


def edit_manifest(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def mutate(bundle: Path) -> None:
        raw = json.loads((bundle / MANIFEST_FILE).read_text())
        fn(raw)
        (bundle / MANIFEST_FILE).write_text(json.dumps(raw, sort_keys=True, indent=2) + "\n")
        reseal_sums(bundle)

    return mutate


def grow_token_count(m: dict) -> None:
    tokens = m["tokens"]
    tokens.update(count=tokens["count"] + 1, stable_tokens=tokens["count"] + 1)
    tokens.update(rendered_tokens=max(tokens["rendered_tokens"], tokens["count"]))


def repeat_a_key(bundle: Path) -> None:
    """A JSON object with one key twice, the first value wrong (one parser takes the first,
    another the last: the same signed bytes would mean two things)."""
    text = (bundle / MANIFEST_FILE).read_text()
    text = text.replace('"ids_sha256": ', f'"ids_sha256": "{"0" * 64}",\n    "ids_sha256": ', 1)
    (bundle / MANIFEST_FILE).write_text(text)
    reseal_sums(bundle)


def first_tensor_dtype(header: dict) -> None:
    name = sorted(k for k in header if k != "__metadata__")[0]
    header[name]["dtype"] = "F64" if header[name]["dtype"] != "F64" else "F32"


def token_outside_vocabulary(header: dict) -> None:
    meta = header["__metadata__"]
    key = next(k for k in meta if k.endswith("token_ids"))
    meta[key] = json.dumps([10**9, *json.loads(meta[key])[1:]], separators=(",", ":"))


def resealed(mutate: Callable[[Path], None]) -> Callable[[Path], None]:
    def both(bundle: Path) -> None:
        mutate(bundle)
        reseal_manifest(bundle)

    return both


# (case, mutation, the stage that refuses it, the field it names, a part of the message)
CASES = [
    ("extra file", lambda b: (b / "notes.txt").write_text("x"), "files", "notes.txt",
     "unexpected 'notes.txt' in the bundle folder"),
    ("missing sums", lambda b: (b / SUMS_FILE).unlink(), "files", SUMS_FILE, "SHA256SUMS is missing"),
    ("garbled sums", lambda b: (b / SUMS_FILE).write_text("nonsense\n"), "checksums", SUMS_FILE, ""),
    ("edited manifest", edit_manifest(grow_token_count), "layout", None, ""),
    ("token counts that disagree",
     edit_manifest(lambda m: m["tokens"].update(stable_tokens=1, rendered_tokens=10**12)),
     "manifest", None, "stable_tokens (1) must be count"),
    ("NaN in the fidelity record",
     edit_manifest(lambda m: m["fidelity"].update(max_abs_logit_diff=float("nan"))), "manifest",
     None, "fidelity.max_abs_logit_diff"),
    ("a key twice, the first value wrong", repeat_a_key, "manifest", MANIFEST_FILE,
     "has the key 'ids_sha256' twice in one object"),
    ("unknown manifest field", edit_manifest(lambda m: m.update(extra=1)), "manifest", None, "extra"),
    ("sums resealed over a changed cache", lambda b: (flip_last_data_byte(b), reseal_sums(b)),
     "cache file", "cache.file_sha256", "SHA256SUMS lists cache.safetensors as"),
    ("header dtype, everything resealed", resealed(edit_header(first_tensor_dtype)), "layout", None, ""),
    ("token id outside the vocabulary, resealed", resealed(edit_header(token_outside_vocabulary)),
     "tokens", None, ""),
    ("unsupported mlx-lm", edit_manifest(lambda m: m["builder"].update(mlx_lm="0.20.0")), "mlx-lm",
     None, "0.20.0"),
    ("request tools not JSON, resealed",
     resealed(edit_manifest(lambda m: m["request"].update(tools_json="{"))), "manifest", None,
     "request.tools_json"),
    ("request tools not function tools, resealed",
     resealed(edit_manifest(lambda m: m["request"].update(tools_json="[1]"))), "manifest", None,
     "request.tools_json"),
    ("request from an unknown server, resealed",
     resealed(edit_manifest(lambda m: m["request"].update(tokenization=["ollama"]))), "manifest",
     None, "request.tokenization"),
    ("flipped data byte", flip_last_data_byte, "data", CACHE_FILE, "cache.safetensors blake3 mismatch"),
]  # fmt: skip


@pytest.fixture
def copy(tmp_path: Path, shop_bundle: Path) -> Path:
    """A copy of the shop bundle outside any <name>/<version> layout (judged by contents alone)."""
    return Path(shutil.copytree(shop_bundle, tmp_path / "bundle"))


def test_a_good_bundle_is_returned_validated_and_loaded_only_when_asked(
    shop_bundle: Path, tiny_model: Path
):
    identity = identity_for(tiny_model)
    manifest = json.loads((shop_bundle / MANIFEST_FILE).read_text())
    checked = validate(shop_bundle, identity)
    assert checked.path == shop_bundle and checked.cache is None
    assert len(checked.tokens) == manifest["tokens"]["count"] == checked.manifest.tokens.count
    loaded = validate(shop_bundle, identity, load=True)
    assert loaded.tokens == checked.tokens
    assert (
        len(loaded.cache)
        == json.loads((tiny_model / "config.json").read_text())["num_hidden_layers"]
    )


@pytest.mark.parametrize(
    ("mutate", "check", "field", "text"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_each_stage_refuses_with_its_name_and_field(
    copy: Path, tiny_model: Path, mutate, check: str, field: str | None, text: str
):
    mutate(copy)
    with pytest.raises(BundleError) as info:
        validate(copy, identity_for(tiny_model))
    exc = info.value
    assert (exc.check, exc.bundle) == (check, str(copy))
    assert field is None or exc.field == field
    assert str(exc).startswith(f"bundle {copy}: ") and text in str(exc)


def test_a_bundle_for_other_weights_is_refused_at_identity(
    shop_bundle: Path, tiny_model_other_weights: Path
):
    with pytest.raises(BundleError) as info:
        validate(shop_bundle, identity_for(tiny_model_other_weights))
    assert (info.value.check, info.value.field) == ("identity", "model.fingerprint")


def test_a_misplaced_bundle_is_refused_at_location(
    tmp_path: Path, shop_bundle: Path, tiny_model: Path
):
    moved = tmp_path / "shop" / "2" / shop_bundle.name  # the manifest says version 1
    shutil.copytree(shop_bundle, moved)
    with pytest.raises(BundleError) as info:
        validate(moved, identity_for(tiny_model))
    assert info.value.check == "location"
    assert f"the folder is shop/2/{shop_bundle.name} but the manifest is for shop/1/" in str(
        info.value
    )


def test_any_other_exception_inside_is_a_refusal_at_its_stage(
    copy: Path, tiny_model: Path, monkeypatch
):
    def crash(*args, **kwargs):
        raise ValueError("boom\nsecond line")

    monkeypatch.setattr(validate_module, "check_identity", crash)
    with pytest.raises(BundleError) as info:
        validate(copy, identity_for(tiny_model))
    assert info.value.check == "identity"
    assert str(info.value) == (
        f"bundle {copy}: cannot be validated (ValueError: boom second line); rebuild or re-copy it"
    )


def test_a_bundle_this_user_cannot_read_says_so_not_rebuild_it(
    copy: Path, tiny_model: Path, monkeypatch
):
    """A PermissionError (a folder mode 000; root reads through it, so raised here where the
    validator lists the folder) is the user's permissions, not a broken bundle."""

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(copy))

    monkeypatch.setattr(validate_module, "check_folder", denied)
    with pytest.raises(BundleError) as info:
        validate(copy, identity_for(tiny_model))
    assert (info.value.check, str(info.value)) == (
        "files",
        f"bundle {copy}: cannot be read (Permission denied: {copy}); check its permissions (this "
        "user must be able to list the folder and read its files)",
    )


def test_checks_lists_every_stage_in_the_order_validate_runs_them():
    """inspect prints CHECKS for a bundle that passes: it must be what the validator does."""
    source = Path(validate_module.__file__).read_text(encoding="utf-8")
    stages = re.findall(r'stage(?:\[0\] = |\s*=\s*\[)"([^"]+)"', source)
    assert [name for name, _ in CHECKS] == stages
    assert {c[2] for c in CASES} <= set(stages)
