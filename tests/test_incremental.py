"""Incremental builds: a child continues its parent's stored KV at the exact shared token (its
first positions are the parent's bytes, rebuilding it gives the same bytes), records its parent,
and refuses a parent it could not continue faithfully."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.builder.builder import BuildResult, build
from pipeline.builder.definition import load_definition
from pipeline.builder.fidelity import CONTINUED_SKIP
from pipeline.builder.targets import targets
from pipeline.format.bundle_folder import CACHE_FILE, MANIFEST_FILE, SUMS_FILE
from pipeline.format.errors import BuildError
from pipeline.format.fingerprint import model_identity
from pipeline.format.manifest import InheritedCheck
from pipeline.format.validate import validate

from conftest import SYSTEM, write_definition

STEP = 16  # small chunks so the tiny prefix spans many of them
MORE = " Returns are accepted within thirty days with the receipt; gift cards are final."
ROOT = Path(__file__).resolve().parent.parent


def define(
    root: Path, model: Path, name: str = "shop", version: int = 1, system: str = SYSTEM, **cache
):
    """prefixes/<name>.toml with this system text and version (chunks of STEP unless given)."""
    path = write_definition(root, model, name, **{"prefill_step_size": STEP, **cache})
    text = path.read_text().replace(json.dumps(SYSTEM), json.dumps(system))
    path.write_text(text.replace("version = 1", f"version = {version}"))
    return path


def run_build(root: Path, name: str = "shop", bundles: Path | None = None, **kwargs) -> BuildResult:
    definition = load_definition(root / "prefixes" / f"{name}.toml", root)
    (target,) = targets(definition, root)
    return build(target, bundles or root / "bundles", **kwargs)


CONTINUED = "; continued from parent "


def cache_sum(bundle: Path) -> list[str]:
    return [ln for ln in (bundle / SUMS_FILE).read_text().splitlines() if ln.endswith(CACHE_FILE)]


def assert_same_as_full_build(result: BuildResult, root: Path, name: str, tmp_path: Path) -> None:
    """A bundle built from token 0 (no parent): its cache file, SHA256SUMS line and manifest are
    those of a build from token 0 in an empty bundles folder."""
    assert result.manifest.parent is None
    checked = result.manifest.fidelity.checked
    full = run_build(root, name, bundles=tmp_path / "full-build", incremental=False, check=checked)
    assert full.manifest.parent is None and full.report["reused_tokens"] == 0
    assert CONTINUED not in (full.manifest.fidelity.reference or "")
    assert "parent" not in json.loads((full.bundle / MANIFEST_FILE).read_text())
    assert (result.bundle / CACHE_FILE).read_bytes() == (full.bundle / CACHE_FILE).read_bytes()
    assert (result.bundle / MANIFEST_FILE).read_bytes() == (
        full.bundle / MANIFEST_FILE
    ).read_bytes()
    assert cache_sum(result.bundle) == cache_sum(full.bundle)


def kv_arrays(bundle: Path) -> dict:
    """The cache file's K/V arrays by name ("<layer>.0" keys, "<layer>.1" values, quantized:
    their parts), positions on axis 2 (not the layout's scalars)."""
    import mlx.core as mx

    return {k: a for k, a in mx.load(str(bundle / CACHE_FILE)).items() if a.ndim == 4}


def same_bytes(a, b) -> bool:
    """Byte equality of two MLX arrays of one dtype (bfloat16 compared as its bits)."""
    import mlx.core as mx

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == mx.bfloat16:
        a, b = a.view(mx.uint16), b.view(mx.uint16)
    return mx.array_equal(a, b).item()


def assert_continues(child: BuildResult, parent: Path) -> int:
    """The child's first N positions (N its recorded reused_tokens, the whole shared token
    prefix) are the parent's stored K/V bytes, every layer; returns N."""
    record = child.manifest.parent
    assert record is not None and record.kind == "continued"
    n = record.reused_tokens
    assert n == shared_tokens(child.bundle, parent) and n == child.report["reused_tokens"]
    mine, theirs = kv_arrays(child.bundle), kv_arrays(parent)
    assert sorted(mine) == sorted(theirs) and mine
    for name, array in mine.items():
        assert same_bytes(array[..., :n, :], theirs[name][..., :n, :]), name
    return n


def assert_rebuilds_to_the_same_bytes(
    child: BuildResult, root: Path, name: str, parent: Path
) -> None:
    """Rebuilt from the same parent, the child is the same cache file and manifest."""
    cache, manifest = ((child.bundle / f).read_bytes() for f in (CACHE_FILE, MANIFEST_FILE))
    again = run_build(root, name, force=True, parent=parent, check=child.manifest.fidelity.checked)
    assert again.manifest.parent.reused_tokens == child.manifest.parent.reused_tokens
    assert (again.bundle / CACHE_FILE).read_bytes() == cache
    assert (again.bundle / MANIFEST_FILE).read_bytes() == manifest


def assert_close_to_full_build(child: BuildResult, root: Path, name: str, tmp_path: Path) -> None:
    """A --full build of the same definition: the same tokens, layout and sizes, K/V equal to the
    child's within float tolerance (the continuation differs from it in the last bits)."""
    import mlx.core as mx

    full = run_build(root, name, bundles=tmp_path / "full-build", incremental=False)
    assert full.manifest.parent is None
    for section in ("tokens", "text", "model", "builder"):
        assert getattr(full.manifest, section) == getattr(child.manifest, section)
    assert full.manifest.cache.file_bytes == child.manifest.cache.file_bytes
    assert full.manifest.build_key == child.manifest.build_key  # the parent is recorded apart
    mine, theirs = kv_arrays(child.bundle), kv_arrays(full.bundle)
    for key, array in mine.items():
        assert mx.allclose(array, theirs[key], rtol=1e-4, atol=1e-5).item(), key


@pytest.mark.parametrize("step", [STEP, 256], ids=["many-chunks", "one-chunk"])
def test_a_new_version_with_appended_text_continues_the_old_one(
    tmp_path: Path, tiny_model: Path, step: int
):
    """v2 continues v1's stored KV at the exact shared token (not at a chunk boundary), in chunks
    starting there; rebuilt from the same parent it is the same bytes."""
    root = tmp_path / "project"
    base = SYSTEM if step == STEP else " ".join([SYSTEM] * 12)  # shares more than a chunk of 256
    define(root, tiny_model, system=base, prefill_step_size=step)
    old = run_build(root, check=True)
    define(root, tiny_model, version=2, system=base + MORE, prefill_step_size=step)
    new = run_build(root, check=True)
    parent = new.manifest.parent
    assert parent is not None and (parent.prefix, parent.version) == ("shop", 1)
    assert parent.folder == old.bundle.name
    assert parent.file_sha256 == old.manifest.cache.file_sha256
    assert (parent.kind, parent.stored_dtype) == ("continued", "float32")
    n = assert_continues(new, old.bundle)
    assert n % STEP != 0 and n < new.manifest.tokens.count  # not a chunk boundary
    assert new.report["reuse"].startswith(f"reused {n:,} tokens from shop@1")
    assert new.manifest.fidelity.greedy_match  # warm from the bundle equals its in-memory cache
    assert parent.checked == (
        "built by this builder (its private build record pins this manifest: no recompute)"
    )
    f = new.manifest.fidelity
    assert f.reference == (
        f"builder continuation: float32 compute on cpu, chunks of {step} tokens, KV stored as "
        f"float32{CONTINUED}shop@1/{old.bundle.name} at token {n:,} (cache sha256 "
        f"{old.manifest.cache.file_sha256[:16]}..): its float32 K/V as stored, the new tokens "
        "prefilled on top; not an independent prefill from token 0"
    )
    # no hidden cold prefill: the serving comparison is the parent's, for the positions it gave
    assert f.serving is None and f.serving_skipped == CONTINUED_SKIP
    where = f"shop@1/{old.bundle.name}"
    assert f.inherited == InheritedCheck(
        bundle=where, tokens=n, serving=old.manifest.fidelity.serving
    )
    identity = replace(model_identity(tiny_model), template=new.manifest.model.template_sha256)
    validate(new.bundle, identity, load=True)  # the one validator accepts the child
    assert_rebuilds_to_the_same_bytes(new, root, "shop", old.bundle)
    assert_close_to_full_build(new, root, "shop", tmp_path)


def test_a_child_asked_for_the_serving_check_runs_a_cold_prefill(tmp_path: Path, tiny_model: Path):
    """check.serving = true: the child is compared with a cold prefill from token 0 (which it is
    not: same_as_builder is false) and inherits nothing."""
    root = tmp_path / "project"
    define(root, tiny_model)
    run_build(root, check=True)
    path = define(root, tiny_model, version=2, system=SYSTEM + MORE)
    path.write_text(path.read_text() + "\n[check]\nserving = true\n")
    f = run_build(root, check=True).manifest.fidelity
    assert f.serving is not None and not f.serving.same_as_builder and f.inherited is None
    assert f.serving.greedy_match and f.serving.max_abs_logit_diff < 1e-3


def test_a_sibling_definition_sharing_the_start_is_a_parent(tmp_path: Path, tiny_model: Path):
    root = tmp_path / "project"
    define(root, tiny_model)
    shop = run_build(root).bundle
    define(root, tiny_model, name="shop-returns", system=SYSTEM + MORE)
    sibling = run_build(root, "shop-returns")
    assert sibling.manifest.parent is not None and sibling.manifest.parent.prefix == "shop"
    assert_continues(sibling, shop)
    assert_close_to_full_build(sibling, root, "shop-returns", tmp_path)


def test_nothing_to_reuse_builds_from_token_zero_and_says_why(tmp_path: Path, tiny_model: Path):
    root = tmp_path / "project"
    define(root, tiny_model)
    first = run_build(root)
    assert first.manifest.parent is None and first.report["reused_tokens"] == 0
    assert (
        first.report["reuse"]
        == "no earlier bundle shares a prefill chunk's worth of tokens (or 256) with these tokens"
    )
    # a rebuild of the same bundle never starts from itself
    again = run_build(root, force=True)
    assert again.manifest.parent is None
    assert (again.bundle / MANIFEST_FILE).read_bytes() == (
        first.bundle / MANIFEST_FILE
    ).read_bytes()


def _flip_data_byte(bundle: Path) -> None:
    raw = bytearray((bundle / CACHE_FILE).read_bytes())
    raw[-100] ^= 0x01
    (bundle / CACHE_FILE).write_bytes(bytes(raw))


PARENTS = {
    # what differs in the parent -> (definition options, model fixture, edit, expected reason)
    "other weights": ({}, "tiny_model_other_weights", None, "built for other weights"),
    "quantized": (
        {"kv_bits": 8, "kv_group_size": 32},
        "tiny_model",
        None,
        "its cache is quantized (8-bit)",
    ),
    "tampered": ({}, "tiny_model", _flip_data_byte, "refused by the validator"),
}


@pytest.mark.parametrize("case", PARENTS)
def test_a_parent_that_cannot_be_continued_is_refused(
    tmp_path: Path, tiny_model: Path, case: str, request
):
    options, model_fixture, edit, reason = PARENTS[case]
    parent_root = tmp_path / "parent"
    define(parent_root, request.getfixturevalue(model_fixture), **options)
    parent = run_build(parent_root).bundle
    if edit:
        edit(parent)
    root = tmp_path / "project"
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    with pytest.raises(
        BuildError, match=re.escape(f"--parent {parent}: cannot be reused ({reason}")
    ):
        run_build(root, parent=parent)
    assert not (root / "bundles" / "shop").exists()  # nothing half-written
    # looking on its own, the builder passes over it and prefills from token 0
    auto = run_build(root, bundles=parent_root / "bundles")
    assert auto.manifest.parent is None and auto.report["reused_tokens"] == 0


def test_cli_reports_the_reuse_and_full_turns_it_off(tmp_path: Path, tiny_model: Path):
    root = tmp_path / "project"
    define(root, tiny_model)
    run_build(root)
    define(root, tiny_model, version=2, system=SYSTEM + MORE)

    def cli(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, str(ROOT / "build.py"), "build", "--no-check", *args]
        return subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=300)

    full = cli("--full", "--json")
    assert full.returncode == 0, full.stderr
    assert json.loads(full.stdout)["targets"][0]["reused_tokens"] == 0
    assert "incremental builds off (--full)" in full.stderr
    inc = cli("--force", "--json")
    assert inc.returncode == 0, inc.stderr
    reused = json.loads(inc.stdout)["targets"][0]["reused_tokens"]
    assert reused > 0 and f"reused {reused:,} tokens from shop@1" in inc.stderr
    bad = cli("--parent", str(root / "nowhere"))  # checked even when up to date
    errors = [ln for ln in bad.stderr.splitlines() if ln.startswith("error:")]
    assert bad.returncode == 1 and errors == [bad.stderr.splitlines()[-1]]
    assert errors[0].startswith(f"error: --parent {root / 'nowhere'}: no such bundle folder")


def test_a_candidate_with_special_files_is_passed_over_without_reading_them(
    tmp_path: Path, tiny_model: Path
):
    """Discovery reads only regular files: a FIFO as a candidate's cache file (which would block
    an open) or a symlinked one is skipped, and the build goes on from token 0."""
    root = tmp_path / "project"
    define(root, tiny_model)
    base = run_build(root).bundle
    cache = base / CACHE_FILE
    cache.unlink()
    os.mkfifo(cache)
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    new = run_build(root)
    assert new.manifest.parent is None and new.report["reused_tokens"] == 0
    with pytest.raises(BuildError, match=r"cannot be reused \(.*not a regular file"):
        run_build(root, parent=base, force=True)


# --- a tampered parent (issue 16, finding 2) ------------------------------------------------------


def retamper(bundle: Path, layers: list[int], positions: range, keep_sha256: bool = False) -> None:
    """Alter the K/V of these positions in these layers, then rewrite the manifest's pins and
    SHA256SUMS so that the bundle passes the validator (the format has no signature here);
    `keep_sha256`: rewrite only the BLAKE3 pin (the one a build's read checks), leaving the
    genuine sha256 (and, format 5, block pins) everywhere."""
    import numpy as np

    from pipeline.format.bundle_folder import sums_text
    from pipeline.format.fingerprint import file_digests, sha256_bytes
    from pipeline.format.manifest import Manifest, manifest_bytes
    from pipeline.format.safetensors_read import DTYPE_SIZES, read_header

    header = read_header(bundle / CACHE_FILE)
    raw = bytearray((bundle / CACHE_FILE).read_bytes())
    for layer in layers:
        for name in (f"{layer}.0", f"{layer}.1"):  # keys, values: (1, heads, tokens, head_dim)
            t = header.by_name()[name]
            _, heads, count, dim = t.shape
            size = DTYPE_SIZES[t.dtype]
            kind, bit = (np.uint32, 1 << 14) if size == 4 else (np.uint16, 1 << 2)
            for h in range(heads):
                offset = t.start + (h * count + positions.start) * dim * size
                n = len(positions) * dim
                np.frombuffer(raw, dtype=kind, count=n, offset=offset)[:] ^= bit
    (bundle / CACHE_FILE).write_bytes(bytes(raw))
    d = file_digests(bundle / CACHE_FILE)
    m = Manifest.model_validate_json((bundle / MANIFEST_FILE).read_bytes())
    sha256 = m.cache.file_sha256 if keep_sha256 else d.sha256
    update = {"file_sha256": sha256, "file_blake3": d.blake3}
    if m.cache.blocks is not None and not keep_sha256:  # format 5: the block pins too
        from pipeline.format.bundle_writer import block_record

        update["blocks"] = block_record(bundle / CACHE_FILE, m.tokens.count)
    cache = m.cache.model_copy(update=update)
    data = manifest_bytes(m.model_copy(update={"cache": cache}))
    (bundle / MANIFEST_FILE).write_bytes(data)
    (bundle / SUMS_FILE).write_text(
        sums_text({CACHE_FILE: sha256, MANIFEST_FILE: sha256_bytes(data)})
    )


def shared_tokens(a: Path, b: Path) -> int:
    """How many leading token ids two bundles share."""
    from pipeline.format.cache_codec import read_cache

    ids = [json.loads(read_cache(x / CACHE_FILE)[1]["token_ids"]) for x in (a, b)]
    return next(
        (i for i, (x, y) in enumerate(zip(*ids, strict=False)) if x != y), min(map(len, ids))
    )


TAMPERED = {
    # what was altered -> (layers, which reused chunk; -1: the last), the chunk that shows it
    "chunk 0, every layer": ("all", 0, 0),
    "a middle chunk, the first layer": ([0], 2, -1),  # seen through the last chunk's attention
    "the last reused chunk, the last layer": ("last", -1, -1),
}


@pytest.mark.parametrize("case", TAMPERED)
def test_a_tampered_parent_is_refused_and_the_child_is_a_full_builds(
    tmp_path: Path, tiny_model: Path, case: str, capsys
):
    """A parent whose K/V were altered and whose pins were rewritten passes the validator; the
    spot check recomputes chunks from token 0 and refuses it: the build prefills from token 0
    (a warning says why) and --parent fails."""
    from pipeline.cli import main

    root = tmp_path / "project"
    define(root, tiny_model)
    old = run_build(root)
    identity = replace(model_identity(tiny_model), template=old.manifest.model.template_sha256)
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    layers, chunk, seen = TAMPERED[case]
    total = len(old.manifest.cache.classes)
    shared = shared_tokens(
        old.bundle, run_build(root, bundles=tmp_path / "v2", incremental=False).bundle
    )
    last, count = (shared - 1) // STEP, old.manifest.tokens.count  # the chunk holding token N-1
    chunk, seen = (last if chunk == -1 else chunk), (last if seen == -1 else seen)
    layers = (
        {"all": list(range(total)), "last": [total - 1]}[layers]
        if isinstance(layers, str)
        else layers
    )
    retamper(old.bundle, layers, range(chunk * STEP, min((chunk + 1) * STEP, count)))
    validate(old.bundle, identity, load=True)  # the validator alone cannot tell

    with pytest.raises(BuildError) as refused:
        run_build(root, parent=old.bundle, parent_check="chunks")
    assert str(refused.value).startswith(
        f"--parent {old.bundle}: cannot be reused (recomputed from token 0, chunk {seen} (tokens "
        f"{seen * STEP}-{min((seen + 1) * STEP, count)}) differs from the parent's in layer "
    )
    capsys.readouterr()
    code = main(["--prefixes", str(root / "prefixes"), "--bundles", str(root / "bundles"),
                 "build", "--no-check", "--parent-check", "chunks"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0, err
    warning = f"warning: prefilled from token 0; refused as a parent: {old.bundle}: recomputed"
    assert warning in err
    new = run_build(root)  # up to date: the CLI's build
    assert new.up_to_date and new.manifest.parent is None
    assert_same_as_full_build(new, root, "shop", tmp_path)


def test_with_trusted_keys_a_parent_must_be_signed(tmp_path: Path, tiny_model: Path):
    """build --trusted-key: an unsigned parent is refused (validated in one place, with the
    keys), a parent signed by one of the keys is used and the record says so."""
    from pipeline.builder.signing import sign_bundle
    from pipeline.format.secret_key import generate

    root = tmp_path / "project"
    define(root, tiny_model)
    old = run_build(root)
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    key = generate()
    keys = (key.public_key(),)
    with pytest.raises(BuildError, match=r"cannot be reused \(refused by the validator: .*sign"):
        run_build(root, parent=old.bundle, trusted_keys=keys)
    unsigned = run_build(root, trusted_keys=keys)  # looking on its own: from token 0
    assert unsigned.manifest.parent is None and unsigned.report["reused_tokens"] == 0
    sign_bundle(old.bundle, key)
    signed = run_build(root, trusted_keys=keys, force=True)
    assert signed.manifest.parent is not None
    assert signed.manifest.parent.checked == "signed by a trusted key (validated: no recompute)"


@pytest.mark.parametrize("policy", ["proven", "sample", "chunks"])
def test_a_parent_this_builder_did_not_write_follows_the_parent_check(
    tmp_path: Path, tiny_model: Path, policy: str, monkeypatch
):
    """A copied-in parent (not in this builder's private build record): proven (the default)
    does not reuse it and says why; sample and chunks spot check it and continue it; the
    manifest says how the parent was trusted."""
    root = tmp_path / "project"
    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "builder-a"))
    define(root, tiny_model)
    old = run_build(root)
    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "builder-b"))  # another builder
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    new = run_build(root, parent_check=policy)
    parent = new.manifest.parent
    if policy == "proven":
        assert parent is None and new.report["reused_tokens"] == 0
        assert "neither signed by a --trusted-key nor built by this builder" in new.report["reuse"]
        assert "parent_warning" in new.report
        assert_same_as_full_build(new, root, "shop", tmp_path)
    elif policy == "sample":
        assert parent.checked == (
            "spot check: neither signed by a --trusted-key nor built by this builder; two "
            f"64-token windows recomputed (tokens 0-64 and {parent.reused_tokens - 64}-"
            f"{parent.reused_tokens}) matched within tolerance"
        )
    else:
        assert parent.checked.startswith("spot check: neither signed by a --trusted-key nor built")
        assert parent.checked.endswith("byte-identical")
    if parent is not None:
        assert_continues(new, old.bundle)
        # the spot check's time goes to build-report.json: identical inputs, identical manifest
        assert new.report["parent_check_seconds"] > 0
        manifest = (new.bundle / MANIFEST_FILE).read_bytes()
        again = run_build(root, parent_check=policy, force=True)
        assert again.manifest.parent.checked == parent.checked
        assert (again.bundle / MANIFEST_FILE).read_bytes() == manifest
    # a child built from token 0 here is in the build record: the next version reuses it with no
    # recompute; one continuing a spot-checked parent is not (a spot check is not a proof, and
    # the record must not turn it into one for every descendant): the next one starts anew
    define(root, tiny_model, version=3, system=SYSTEM + MORE + " Ask for the order id first.")
    third = run_build(root)
    if parent is None:
        assert third.manifest.parent is not None and third.manifest.parent.version == 2
        assert third.manifest.parent.checked.startswith("built by this builder")
    else:
        assert third.manifest.parent is None and "parent_warning" in third.report


def test_a_child_of_a_spot_checked_parent_is_never_signed(
    tmp_path: Path, tiny_model: Path, monkeypatch
):
    """A signature vouches for every byte: --sign-key refuses a child whose parent was reused on
    a spot check, new or up to date (before: it signed it, and `verify --trusted-key` then
    vouched for a child of an altered parent), and nothing is published or signed."""
    from pipeline.format.bundle_folder import SIGNATURE_FILE
    from pipeline.format.secret_key import generate

    root = tmp_path / "project"
    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "builder-a"))
    define(root, tiny_model)
    run_build(root)
    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "builder-b"))
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    key = generate()
    with pytest.raises(BuildError, match="reused on a spot check, which is not a proof"):
        run_build(root, parent_check="sample", sign_key=key)
    assert not (root / "bundles" / "shop" / "2").exists()
    child = run_build(root, parent_check="sample")  # unsigned: as asked
    with pytest.raises(BuildError, match="reused on a spot check, which is not a proof"):
        run_build(root, parent_check="sample", sign_key=key)  # up to date: signing it is refused
    assert not (child.bundle / SIGNATURE_FILE).exists()


def test_the_sample_check_refuses_a_grossly_edited_first_window(tmp_path: Path, tiny_model: Path):
    """Its limit is documented (a spot check); what it looks at, it catches."""
    root = tmp_path / "project"
    define(root, tiny_model)
    old = run_build(root)
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    total = len(old.manifest.cache.classes)
    retamper(old.bundle, list(range(total)), range(0, 4))
    with pytest.raises(BuildError, match=r"recomputed from token 0, tokens 0-64 differ"):
        run_build(root, parent=old.bundle, parent_check="sample")


def test_a_parent_folder_named_otherwise_is_recorded_by_its_layout_name(
    tmp_path: Path, tiny_model: Path
):
    """--parent "Parent Copy" (an exact copy of a bundle built here): the child records the
    parent's folder as the layout names it (before: the copy's name failed the manifest schema,
    a pydantic traceback)."""
    root = tmp_path / "project"
    define(root, tiny_model)
    old = run_build(root)
    copy = Path(shutil.copytree(old.bundle, tmp_path / "Parent Copy"))
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    child = run_build(root, parent=copy)
    assert child.manifest.parent is not None and child.manifest.parent.folder == old.bundle.name


def test_a_spot_checked_parent_must_have_the_sha256_it_pins(
    tmp_path: Path, tiny_model: Path, monkeypatch
):
    """An unsigned parent not built here whose bytes were altered away from the spot check's
    windows, with only its BLAKE3 pin rewritten (`verify` and `sha256sum -c` refuse it): it was
    continued, and the child recorded the genuine sha256 of bytes it never continued. Now it is
    passed over, saying why."""
    root = tmp_path / "project"
    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "builder-a"))
    define(root, tiny_model)
    old = run_build(root)
    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "builder-b"))
    total = len(old.manifest.cache.classes)
    retamper(old.bundle, [total - 1], range(100, 104), keep_sha256=True)
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    child = run_build(root, parent_check="sample")
    assert child.manifest.parent is None and child.report["reused_tokens"] == 0
    assert "does not have the sha256 it pins" in child.report["reuse"], child.report["reuse"]
