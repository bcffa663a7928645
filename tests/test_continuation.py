"""The continuation contract (issue 39) beyond a float32 child: bfloat16 parents continued as
stored, quantized children of a full-precision parent, a parent's chunk size not mattering, the
chunks check's limits, --full and signing of a child, and what inspect says."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_incremental import (
    MORE,
    assert_continues,
    assert_rebuilds_to_the_same_bytes,
    define,
    kv_arrays,
    run_build,
    same_bytes,
)

from pipeline.format.bundle_folder import CACHE_FILE
from pipeline.testmodels.model import generate_model

from conftest import SYSTEM


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> Path:
    return generate_model(tmp_path_factory.mktemp("bf16") / "tiny-bf16", "tiny", dtype="bfloat16")


def test_a_bfloat16_child_continues_its_parents_stored_kv(tmp_path: Path, bf16_model: Path):
    """The CPU builder computes in float32 and stores bfloat16: the child upcasts the parent's
    stored positions exactly, keeps their bytes and prefills the new tokens on top."""
    root = tmp_path / "project"
    define(root, bf16_model)
    old = run_build(root, check=True)
    assert old.manifest.cache.dtype == "bfloat16"
    define(root, bf16_model, version=2, system=SYSTEM + MORE)
    new = run_build(root, check=True)
    p = new.manifest.parent
    assert p is not None and (p.kind, p.stored_dtype) == ("continued", "bfloat16")
    assert_continues(new, old.bundle)
    f = new.manifest.fidelity
    assert f.reference.startswith("builder continuation: float32 compute on cpu")
    assert "its bfloat16 K/V as stored, the new tokens prefilled on top" in f.reference
    assert f.greedy_match and f.max_abs_logit_diff == 0.0
    assert_rebuilds_to_the_same_bytes(new, root, "shop", old.bundle)


def test_a_quantized_child_continues_a_full_precision_parent(tmp_path: Path, tiny_model: Path):
    """kv_bits: the child continues the full-precision parent and quantizes the whole cache, as a
    build from token 0 does: its first N positions are the parent's, quantized. A quantized
    bundle is never a parent (its rounding error would compound)."""
    import mlx.core as mx

    root = tmp_path / "project"
    define(root, tiny_model)
    old = run_build(root)
    define(root, tiny_model, version=2, system=SYSTEM + MORE, kv_bits=8, kv_group_size=32)
    new = run_build(root, check=True)
    p = new.manifest.parent
    assert p is not None and (p.kind, p.version) == ("continued-quantized", 1)
    n = p.reused_tokens
    parent = kv_arrays(old.bundle)
    mine = kv_arrays(new.bundle)
    for layer in range(len(old.manifest.cache.classes)):
        for part in (0, 1):  # keys, values: (packed, scales, biases)
            quantized = mx.quantize(parent[f"{layer}.{part}"][..., :n, :], group_size=32, bits=8)
            for i, want in enumerate(quantized):
                assert same_bytes(mine[f"{layer}.{part}.{i}"][..., :n, :], want)
    assert new.manifest.fidelity.checked and new.manifest.fidelity.greedy_match is not None
    define(root, tiny_model, version=3, system=SYSTEM + MORE + " Ask for the order id.", kv_bits=8,
           kv_group_size=32)  # fmt: skip
    third = run_build(root)
    assert third.manifest.parent.version == 1  # not the quantized v2
    assert "v2" not in third.report["reuse"]
    assert (
        "its cache is quantized (8-bit): continuing quantized KV would compound"
        in (third.report["reuse"])
    )


def test_a_parent_built_in_other_chunks_is_continued(tmp_path: Path, tiny_model: Path):
    """A continuation does not depend on the parent's chunking: chunks of 32 continue into 16."""
    root = tmp_path / "project"
    define(root, tiny_model, prefill_step_size=32)
    old = run_build(root)
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    new = run_build(root)
    assert new.manifest.cache.prefill_step_size == 16
    assert_continues(new, old.bundle)


def test_the_chunks_check_recomputes_only_a_parent_built_from_token_0(
    tmp_path: Path, tiny_model: Path, monkeypatch
):
    """Another builder's v2 continued v1: --parent-check chunks cannot recompute it byte for byte
    (its chunks started at v1's shared token) and says so; it checks and continues v1 instead."""
    root = tmp_path / "project"
    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "builder-a"))
    define(root, tiny_model)
    v1 = run_build(root)
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    v2 = run_build(root)
    assert v2.manifest.parent is not None
    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "builder-b"))
    define(root, tiny_model, version=3, system=SYSTEM + MORE + " Ask for the order id first.")
    v3 = run_build(root, parent_check="chunks")
    assert v3.manifest.parent.version == 1 and "byte-identical" in v3.manifest.parent.checked
    assert (
        f"{v2.bundle}: not reused: neither signed by a --trusted-key nor built by this builder; "
        "--parent-check chunks recomputes a parent byte for byte, which needs one built from "
        "token 0 that stores its compute dtype (this one continued shop@1); pass --parent-check "
        "sample, or sign it and pass --trusted-key"
    ) in v3.report["reuse"]
    assert_continues(v3, v1.bundle)


def test_full_rebuilds_a_child_from_token_0_and_a_child_is_signed_after_a_rebuild(
    tmp_path: Path, tiny_model: Path
):
    """A child is not 'up to date' for --full; signing an up-to-date child that nothing proves
    rebuilds it from the parent it names and compares."""
    from pipeline.format.secret_key import generate

    root = tmp_path / "project"
    define(root, tiny_model)
    run_build(root)
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    child = run_build(root)
    signed = run_build(root, sign_key=generate())
    assert signed.up_to_date and signed.report["signed"] == "rebuilt from its parent and compared"
    assert (signed.bundle / CACHE_FILE).read_bytes() == (child.bundle / CACHE_FILE).read_bytes()
    full = run_build(root, incremental=False)
    assert not full.up_to_date and full.manifest.parent is None
    again = run_build(root, incremental=False)
    assert again.up_to_date


def test_inspect_says_which_kind_of_child_a_bundle_is(tmp_path: Path, tiny_model: Path, capsys):
    from pipeline.cli import main

    root = tmp_path / "project"
    define(root, tiny_model)
    old = run_build(root, check=True)
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    new = run_build(root, check=True)
    n = new.manifest.parent.reused_tokens
    capsys.readouterr()
    assert main(["inspect", str(new.bundle), "--model", str(tiny_model)]) == 0
    out = capsys.readouterr().out
    sha = old.manifest.cache.file_sha256[:16]
    assert (
        f"  parent: continued from shop@1/{old.bundle.name} (cache sha256 {sha}..) at token "
        f"{n:,}: its first {n:,} positions are that bundle's stored float32 K/V, unchanged, the "
        "new tokens prefilled on top; as trustworthy as that parent; 'build --full' builds from "
        "token 0 and owes no other bundle anything"
    ) in out
    assert (
        f"  info serving path           inherited from shop@1/{old.bundle.name} (its stored "
        f"positions are this bundle's first {n:,}): max |logit diff| "
    ) in out
    assert "vs a cold float32 prefill on cpu (chunks of 2048), greedy match True" in out


def test_a_parent_built_here_is_read_once_and_not_hashed_again(
    tmp_path: Path, tiny_model: Path, monkeypatch
):
    """Its build hashed the cache file and carried the memo entry to where it was published: the
    child's validation of it loads it without hashing; an in-place edit since (a new ctime) is
    hashed again."""
    import pipeline.format.validate as validate_module

    root = tmp_path / "project"
    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "memo"))
    define(root, tiny_model)
    old = run_build(root)
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    reads: list[tuple[str, tuple]] = []
    real = validate_module.read_data

    def spy(source, header, *, digests, load):
        reads.append((str(source.real_path()), digests))
        return real(source, header, digests=digests, load=load)

    monkeypatch.setattr(validate_module, "read_data", spy)
    run_build(root)
    parent_reads = [d for path, d in reads if path.startswith(str(old.bundle.resolve()))]
    assert parent_reads == [()]
    (old.bundle / CACHE_FILE).write_bytes((old.bundle / CACHE_FILE).read_bytes())  # new ctime
    reads.clear()
    run_build(root, force=True)
    parent_reads = [d for path, d in reads if path.startswith(str(old.bundle.resolve()))]
    assert parent_reads == [("blake3",)]
