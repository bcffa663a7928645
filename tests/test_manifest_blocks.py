"""Format 5's cache.blocks: the manifest pins the cache file block by block (the blobs an OCI
artifact carries), the validator checks the record, the tiling and, for verify, every block."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fuzz_corpus import reseal_sums

from pipeline.distribute.blocks import Source, read_layout
from pipeline.format.bundle_folder import CACHE_FILE, MANIFEST_FILE
from pipeline.format.cache_blocks import record_sha256
from pipeline.format.errors import BundleError
from pipeline.format.served_identity import identity_for
from pipeline.format.validate import validate
from pipeline.runtime import mount, verify


def rewrite(bundle: Path, change) -> None:
    """Edit manifest.json, then recompute SHA256SUMS (anyone can)."""
    raw = json.loads((bundle / MANIFEST_FILE).read_text())
    change(raw)
    (bundle / MANIFEST_FILE).write_text(json.dumps(raw, sort_keys=True, indent=2) + "\n")
    reseal_sums(bundle)


@pytest.fixture
def copy(tmp_path: Path, shop_bundle: Path) -> Path:
    return Path(shutil.copytree(shop_bundle, tmp_path / "bundle"))


def test_a_build_pins_the_blocks_a_push_cuts(shop_bundle: Path):
    """The record holds the sha256 of exactly the header, rest and blocks the OCI artifact
    carries (distribute.blocks cuts them from the file by the same rule)."""
    raw = json.loads((shop_bundle / MANIFEST_FILE).read_text())
    assert raw["format_version"] == 5
    pins = raw["cache"]["blocks"]
    plan = read_layout(shop_bundle / CACHE_FILE, raw["tokens"]["count"])
    source = Source(shop_bundle / CACHE_FILE, plan)
    try:
        import hashlib

        found = [hashlib.sha256(source.block(k)).hexdigest() for k in range(plan.blocks)]
        rest = hashlib.sha256(source.rest()).hexdigest()
    finally:
        source.close()
    assert plan.blocks >= 2 and pins["sha256"] == found
    assert (pins["block_tokens"], pins["rest_sha256"]) == (plan.block_tokens, rest)
    assert pins["header_sha256"] == hashlib.sha256(plan.header).hexdigest()
    assert pins["record_sha256"] == record_sha256(
        plan.block_tokens, pins["header_sha256"], rest, found
    )


def test_one_edited_block_digest_is_refused_by_every_path_when_the_manifest_is_read(
    copy: Path, tiny_model: Path
):
    rewrite(copy, lambda m: m["cache"]["blocks"]["sha256"].__setitem__(1, "0" * 64))
    for check in (lambda: verify(copy, tiny_model), lambda: mount(tiny_model, copy)):
        with pytest.raises(BundleError) as info:
            check()
        assert info.value.check == "manifest"
        assert "an edited block record" in info.value.reason


def test_verify_proves_every_block_against_its_pin(copy: Path, tiny_model: Path):
    """A record rewritten whole (its own digest too) with one wrong block: verify hashes every
    block and names the one that differs; the whole-file pins still hold."""

    def wrong_block(m: dict) -> None:
        b = m["cache"]["blocks"]
        b["sha256"][1] = "0" * 64
        b["record_sha256"] = record_sha256(
            b["block_tokens"], b["header_sha256"], b["rest_sha256"], b["sha256"]
        )

    rewrite(copy, wrong_block)
    with pytest.raises(BundleError) as info:
        verify(copy, tiny_model)
    b = json.loads((copy / MANIFEST_FILE).read_text())["cache"]["blocks"]
    t1 = min(
        2 * b["block_tokens"], json.loads((copy / MANIFEST_FILE).read_text())["tokens"]["count"]
    )
    assert (info.value.check, info.value.field) == ("data", "cache.blocks.sha256")
    assert info.value.reason.startswith(
        f"cache.safetensors block 1 (tokens {b['block_tokens']}-{t1 - 1}) hashes to "
    )
    assert info.value.reason.endswith(
        f", the manifest pins {'0' * 12}..; the bundle was altered: rebuild or re-copy it"
    )


def test_a_record_that_does_not_cut_the_file_is_refused_before_any_data_is_read(
    copy: Path, tiny_model: Path
):
    def other_size(m: dict) -> None:
        b = m["cache"]["blocks"]
        b["block_tokens"] = 16  # 4x the blocks the record lists
        b["record_sha256"] = record_sha256(16, b["header_sha256"], b["rest_sha256"], b["sha256"])

    rewrite(copy, other_size)
    count = len(json.loads((copy / MANIFEST_FILE).read_text())["cache"]["blocks"]["sha256"])
    for check in (lambda: verify(copy, tiny_model), lambda: mount(tiny_model, copy)):
        with pytest.raises(BundleError) as info:
            check()
        assert (info.value.check, info.value.field) == ("layout", "cache.blocks.sha256")
        assert info.value.reason.startswith(f"the manifest pins {count} blocks of 16 tokens, ")


def test_a_format_3_bundle_is_still_read_and_proven_whole(copy: Path, tiny_model: Path):
    def older(m: dict) -> None:
        m["format_version"] = 3
        del m["cache"]["blocks"]

    rewrite(copy, older)
    assert verify(copy, tiny_model).format_version == 3
    (mounted,) = mount(tiny_model, copy).bundles
    assert mounted.manifest.cache.blocks is None


def test_a_format_5_manifest_without_blocks_or_a_format_3_one_with_them_is_refused(
    copy: Path, tiny_model: Path
):
    rewrite(copy, lambda m: m["cache"].pop("blocks"))
    with pytest.raises(BundleError, match="cache.blocks is required in format 5 and only there"):
        validate(copy, identity_for(tiny_model))


def test_a_proof_for_another_file_state_is_not_taken(copy: Path, tiny_model: Path, tmp_path):
    """validate skips hashing only for a proof of this very file, unchanged, and of the record
    its manifest pins: a proof with another record (or an older stat) hashes the file, and a
    changed byte is then refused."""
    import os

    from pipeline.format import memo
    from pipeline.format.validate import BlockProof

    path = copy / CACHE_FILE
    record = json.loads((copy / MANIFEST_FILE).read_text())["cache"]["blocks"]["record_sha256"]
    with open(path, "r+b") as fh:  # a byte changed in place after the proof was taken
        key = memo.open_key(os.path.realpath(path), os.fstat(fh.fileno()))
        fh.seek(os.path.getsize(path) - 1)
        last = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([last[0] ^ 1]))
    identity = identity_for(tiny_model)
    for proof in (BlockProof(key, record), BlockProof(key, "0" * 64)):
        with pytest.raises(BundleError) as info:
            validate(copy, identity, trust_memo=True, proof=proof)
        assert info.value.check in ("cache file", "data")


def test_a_prefix_with_more_blocks_than_a_manifest_pins_is_one_line_before_any_prefill(
    tmp_path: Path,
):
    """A manifest pins at most MAX_BLOCKS blocks: a longer prefix (a 1M-context model's) is
    refused in one line before its prefill, and the writer's own check of the real file is one
    line too (it raised pydantic's ValidationError after the whole prefill)."""
    from types import SimpleNamespace

    import mlx.core as mx

    from pipeline.builder.prefill import check_blocks
    from pipeline.format.bundle_writer import block_record
    from pipeline.format.errors import BuildError
    from pipeline.format.fingerprint import ModelShape
    from pipeline.format.manifest import MAX_BLOCKS

    shape = ModelShape(28, 4, 128, 152064, 1_010_000, None)  # Qwen2.5-7B-Instruct-1M
    definition = SimpleNamespace(path=tmp_path / "long.toml")
    check_blocks(definition, MAX_BLOCKS * 64, shape, mx.bfloat16, None)  # 768,000: the most
    with pytest.raises(BuildError, match=r"long\.toml: the prefix is 800,000 tokens: 12,500 "):
        check_blocks(definition, 800_000, shape, mx.bfloat16, None)
    tokens = MAX_BLOCKS * 64 + 1  # one row of 2 bytes per token: B is 64
    path = tmp_path / CACHE_FILE
    mx.save_safetensors(str(path), {"0.keys": mx.zeros((1, 1, tokens, 1), mx.float16)})
    with pytest.raises(BuildError, match=r"^the prefix is 768,001 tokens: 12,001 cache blocks"):
        block_record(path, tokens)
