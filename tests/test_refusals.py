"""A bundle that does not match the served model, or was damaged, is refused and never loaded."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.format.bundle_folder import CACHE_FILE, MANIFEST_FILE, SUMS_FILE
from pipeline.format.errors import BundleError
from pipeline.format.fingerprint import sha256_file
from pipeline.runtime import PromptCacheManager, mount


def flip_byte(bundle: Path, model: Path) -> None:
    data = bytearray((bundle / CACHE_FILE).read_bytes())
    data[-5] ^= 0x01
    (bundle / CACHE_FILE).write_bytes(bytes(data))


def edit_manifest(bundle: Path, model: Path) -> None:
    raw = json.loads((bundle / MANIFEST_FILE).read_text())
    raw["tokens"]["count"] += 1
    (bundle / MANIFEST_FILE).write_text(json.dumps(raw, sort_keys=True, indent=2) + "\n")


def drop_sums(bundle: Path, model: Path) -> None:
    (bundle / SUMS_FILE).unlink()


def other_tokenizer(bundle: Path, model: Path) -> None:
    path = model / "tokenizer.json"
    raw = json.loads(path.read_text())
    raw["normalizer"] = None  # same vocabulary, different normalization: a different tokenizer
    path.write_text(json.dumps(raw))


def other_template(bundle: Path, model: Path) -> None:
    path = model / "tokenizer_config.json"
    raw = json.loads(path.read_text())
    raw["chat_template"] = raw["chat_template"].replace("<|im_start|>system", "<|im_start|>system ")
    path.write_text(json.dumps(raw))


def other_weights(bundle: Path, model: Path) -> None:
    pass  # the case swaps in the seed-1 model folder instead


CASES: list[tuple[str, Callable[[Path, Path], None], str, str]] = [
    ("flipped byte", flip_byte, CACHE_FILE, "cache.safetensors blake3 mismatch"),
    ("edited manifest", edit_manifest, MANIFEST_FILE, "manifest.json sha256 mismatch"),
    ("missing SHA256SUMS", drop_sums, SUMS_FILE, "SHA256SUMS is missing"),
    ("other weights", other_weights, "model.fingerprint", "model weights/config mismatch"),
    ("other tokenizer", other_tokenizer, "model.tokenizer_fingerprint", "tokenizer mismatch"),
    ("other template", other_template, "model.template_sha256", "chat template mismatch"),
]


@pytest.fixture
def damaged(
    request, tmp_path: Path, shop_bundle: Path, tiny_model: Path, tiny_model_other_weights: Path
):
    """(bundle copy, model copy) with one thing changed, per case."""
    name, change, _, _ = request.param
    bundle = tmp_path / "bundles" / "shop" / "1" / "tiny"
    shutil.copytree(shop_bundle, bundle)
    source = tiny_model_other_weights if name == "other weights" else tiny_model
    model = tmp_path / "model"
    shutil.copytree(source, model)
    change(bundle, model)
    return bundle, model


@pytest.mark.parametrize("damaged", CASES, ids=[c[0] for c in CASES], indirect=True)
def test_mount_refuses_with_the_field_named(damaged, request):
    bundle, model = damaged
    _, _, field, message = next(c for c in CASES if c[0] == request.node.callspec.id)
    manager = PromptCacheManager()
    with pytest.raises(BundleError) as info:
        mount(model, bundle, manager=manager)
    assert info.value.field == field
    assert message in str(info.value)
    assert manager.stats()["pinned"] == 0

    skipped = mount(model, bundle, skip_refused=True, manager=manager)
    assert skipped.bundles == [] and [r.field for r in skipped.refused] == [field]
    assert manager.stats()["pinned"] == 0


@pytest.mark.parametrize("damaged", CASES, ids=[c[0] for c in CASES], indirect=True)
def test_verify_cli_refuses_with_one_line(damaged, request, capsys):
    bundle, model = damaged
    _, _, _, message = next(c for c in CASES if c[0] == request.node.callspec.id)
    assert main(["verify", str(bundle), "--model", str(model)]) == 1
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.splitlines()
    assert (
        len(lines) == 1 and lines[0].startswith(f"error: bundle {bundle}: ") and message in lines[0]
    )


def test_mismatch_message_shows_expected_and_found(
    tmp_path: Path, shop_bundle: Path, tiny_model_other_weights: Path
):
    from pipeline.format.fingerprint import model_fingerprint

    expected = json.loads((shop_bundle / MANIFEST_FILE).read_text())["model"]["fingerprint"]
    found = model_fingerprint(tiny_model_other_weights)
    with pytest.raises(BundleError) as info:
        mount(tiny_model_other_weights, shop_bundle)
    assert f"bundle expects {expected[:16]}.., model has {found[:16]}.." in str(info.value)


def test_verify_cli_accepts_a_good_bundle(shop_bundle: Path, tiny_model: Path, capsys):
    assert main(["verify", str(shop_bundle), "--model", str(tiny_model)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"ok {shop_bundle} (shop@1, ")


def test_server_template_override_is_compared(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path, capsys
):
    override = tmp_path / "server.jinja"
    override.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert (
        main(
            [
                "verify",
                str(shop_bundle),
                "--model",
                str(tiny_model),
                "--chat-template",
                str(override),
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "chat template mismatch" in err and "could never be hit" in err


def test_mount_hashes_once_per_file_state_and_verify_always(
    tmp_path: Path, shop_bundle: Path, tiny_model: Path, monkeypatch
):
    from pipeline.format import memo
    from pipeline.runtime import verify

    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "memo"))
    bundle = tmp_path / "b"
    shutil.copytree(shop_bundle, bundle)
    cache_file = bundle / CACHE_FILE
    assert memo.lookup(memo.stat_key(cache_file)) is None
    mount(tiny_model, bundle)  # first sight: hashed in full (BLAKE3), then remembered
    expected = json.loads((bundle / MANIFEST_FILE).read_text())["cache"]["file_blake3"]
    assert memo.lookup(memo.stat_key(cache_file)) == expected
    assert oct(memo.memo_path().stat().st_mode & 0o777) == "0o600"
    assert oct(memo.memo_path().parent.stat().st_mode & 0o777) == "0o700"
    mount(tiny_model, bundle)  # same file state: no re-hash needed

    data = bytearray(cache_file.read_bytes())
    data[-5] ^= 0x01
    stat = cache_file.stat()
    with open(cache_file, "r+b") as fh:  # edited in place: same inode, mtime restored below
        fh.write(bytes(data))
    os.utime(cache_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(BundleError, match="cache.safetensors blake3 mismatch"):
        mount(tiny_model, bundle)  # ctime moved: hashed again, refused
    with pytest.raises(BundleError, match="cache.safetensors blake3 mismatch"):
        verify(bundle, tiny_model)  # deploy-time verify never trusts the memo


def test_a_forged_memo_entry_is_ignored_when_the_memo_is_not_private(
    tmp_path: Path, shop_bundle: Path, tiny_model: Path, monkeypatch
):
    from pipeline.format import memo

    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "memo"))
    bundle = tmp_path / "b"
    shutil.copytree(shop_bundle, bundle)
    flip_byte(bundle, tiny_model)
    expected = json.loads((bundle / MANIFEST_FILE).read_text())["cache"]["file_blake3"]
    memo.store(memo.stat_key(bundle / CACHE_FILE), expected)  # a forged "already verified"
    os.chmod(memo.memo_path(), 0o644)  # open to others: the memo is not trusted at all
    with pytest.raises(BundleError, match="blake3 mismatch"):
        mount(tiny_model, bundle)
    with pytest.raises(BundleError, match="blake3 mismatch"):
        mount(tiny_model, bundle, verify_full=True)


def test_a_bundle_of_the_previous_format_is_refused_with_the_fix(
    tmp_path: Path, shop_bundle: Path, tiny_model: Path
):
    bundle = shutil.copytree(shop_bundle, tmp_path / "b")
    raw = json.loads((bundle / MANIFEST_FILE).read_text())
    raw["format_version"] = 1
    for field in ("file_sha256", "file_blake3", "file_bytes", "blocks"):  # format 1 had none
        del raw["cache"][field]
    (bundle / MANIFEST_FILE).write_text(json.dumps(raw, sort_keys=True, indent=2) + "\n")
    (bundle / SUMS_FILE).write_text(
        "".join(f"{sha256_file(bundle / n)}  {n}\n" for n in (CACHE_FILE, MANIFEST_FILE))
    )
    with pytest.raises(BundleError) as info:
        mount(tiny_model, bundle)
    assert info.value.field == "format_version"
    assert info.value.reason == (
        "format_version 1 is not supported (this runtime reads 2, 3, 4, 5); rebuild it with this version"
    )
