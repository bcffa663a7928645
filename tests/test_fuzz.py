"""Fuzzed bundles: every mutation is refused with BundleError, or accepted with identical output.

`verify`, `inspect` and `mount` must decide the same for every case (they share one validator), no
exception outside BundleError may escape, and an accepted mutation must give bit-identical
next-token logits to the pristine bundle. Counts are printed in the test session summary.
"""

from __future__ import annotations

import contextlib
import io
import re
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from fuzz_corpus import Case, apply, corpus, flip, reseal_sums, signature_corpus, truncate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm import load

from pipeline.builder.signing import sign_bundle
from pipeline.cli import main
from pipeline.format.bundle_folder import CACHE_FILE
from pipeline.format.errors import BundleError
from pipeline.format.secret_key import generate
from pipeline.format.signature import read_trusted_keys
from pipeline.runtime import PromptCacheManager, mount, verify

SUMMARY: dict[str, int] = {}


@pytest.fixture(scope="module")
def loaded(tiny_model: Path):
    return load(str(tiny_model))


@pytest.fixture(scope="module")
def request_tokens(shop_bundle: Path, tiny_model: Path) -> list[int]:
    mounted = mount(tiny_model, shop_bundle)
    return [*mounted.bundles[0].tokens, 27, 872, 198, 13, 42]


def next_logits(loaded, model_dir: Path, bundle: Path, tokens: list[int]) -> mx.array:
    """Next-token logits for the request, continuing from the mounted bundle through the manager."""
    manager = PromptCacheManager()
    result = mount(model_dir, [bundle], manager=manager, model_key="m")
    assert result.bundles, "the mount was expected to succeed"
    hit = manager.fetch("m", tokens)
    model = loaded[0]
    logits = model(mx.array(hit.remaining)[None], cache=hit.cache)[0, -1]
    mx.eval(logits)
    return logits


@pytest.fixture(scope="module")
def pristine_logits(loaded, tiny_model: Path, shop_bundle: Path, request_tokens) -> mx.array:
    return next_logits(loaded, tiny_model, shop_bundle, request_tokens)


def decide(bundle: Path, model: Path, key_file: Path | None = None) -> dict[str, str]:
    """What verify, mount and inspect each decide: 'accepted' or 'refused' (given a trusted key
    file: every bundle must be signed by it)."""
    keys = read_trusted_keys([key_file] if key_file else [])
    out: dict[str, str] = {}
    try:
        verify(bundle, model, trusted_keys=keys)
        out["verify"] = "accepted"
    except BundleError:
        out["verify"] = "refused"
    result = mount(model, [bundle], skip_refused=True, trusted_keys=keys)
    out["mount"] = "accepted" if result.bundles else "refused"
    trust = ["--trusted-key", str(key_file)] if key_file else []
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(["inspect", str(bundle), "--model", str(model), "--json", *trust])
    out["inspect"] = {0: "accepted", 1: "refused"}.get(code, f"exit {code}")
    return out


def check_case(loaded, model: Path, bundle: Path, tokens, pristine) -> str:
    """'refused' or 'accepted-identical'; raises AssertionError on disagreement or changed output."""
    decisions = decide(bundle, model)
    assert len(set(decisions.values())) == 1, f"decisions differ: {decisions}"
    verdict = decisions["verify"]
    if verdict == "accepted":
        logits = next_logits(loaded, model, bundle, tokens)
        assert mx.array_equal(logits, pristine).item(), "accepted, but the output changed"
        return "accepted-identical"
    return "refused"


def families(cases: list[Case]) -> list[Case]:
    """The first and last case of every family (names alike but for their numbers: byte
    positions, layers, tensors), in corpus order: every kind of mutation, at both ends."""
    by_family: dict[str, list[Case]] = {}
    for case in cases:
        by_family.setdefault(re.sub(r"[0-9]+", "#", case.name), []).append(case)
    keep = {id(c) for f in by_family.values() for c in (f[0], f[-1])}
    return [c for c in cases if id(c) in keep]


# `just test` runs every family; the full sweep (about 1.6x the cases) is marked slow.
@pytest.mark.parametrize("sweep", ["families", pytest.param("full", marks=pytest.mark.slow)])
def test_every_corpus_case_is_refused_or_identical(
    sweep: str,
    tmp_path: Path,
    shop_bundle: Path,
    tiny_model: Path,
    loaded,
    request_tokens,
    pristine_logits,
    monkeypatch,
):
    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "memo"))
    cases = corpus(shop_bundle) if sweep == "full" else families(corpus(shop_bundle))
    failures, counts = [], {"refused": 0, "accepted-identical": 0}
    for i, case in enumerate(cases):
        for seal in case.seals:
            bundle = apply(case, seal, shop_bundle, tmp_path / f"c{i}-{seal}" / "bundle")
            try:
                counts[check_case(loaded, tiny_model, bundle, request_tokens, pristine_logits)] += 1
            except Exception as exc:  # noqa: BLE001 - anything escaping is a finding to report
                failures.append(f"{case.name}/{seal}: {exc.__class__.__name__}: {exc}")
            shutil.rmtree(bundle.parent, ignore_errors=True)
    SUMMARY.update(
        sweep=sweep, mutations=len(cases), cases=sum(counts.values()) + len(failures), **counts
    )
    assert not failures, "\n".join(failures)
    assert len(cases) >= 300 and counts["accepted-identical"] > 0 and counts["refused"] > 0


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    position=st.integers(min_value=0, max_value=1 << 20),
    mask=st.integers(min_value=1, max_value=255),
    cut=st.integers(min_value=0, max_value=1 << 20),
    resum=st.booleans(),
)
def test_random_flips_and_truncations(
    tmp_path_factory, shop_bundle: Path, tiny_model: Path, loaded, request_tokens, pristine_logits,
    position: int, mask: int, cut: int, resum: bool,
):  # fmt: skip
    bundle = tmp_path_factory.mktemp("hyp") / "bundle"
    shutil.copytree(shop_bundle, bundle)
    flip(CACHE_FILE, lambda n: position, mask)(bundle)
    if cut:
        truncate(CACHE_FILE, lambda n: n - cut % n)(bundle)
    if resum:
        reseal_sums(bundle)
    assert check_case(loaded, tiny_model, bundle, request_tokens, pristine_logits) == "refused"


def test_a_recomputed_sums_file_alone_never_passes_a_changed_cache(
    tmp_path: Path, shop_bundle: Path, tiny_model: Path
):
    bundle = tmp_path / "b"
    shutil.copytree(shop_bundle, bundle)
    flip(CACHE_FILE, lambda n: n - 5)(bundle)
    reseal_sums(bundle)
    with pytest.raises(BundleError) as info:
        verify(bundle, tiny_model)
    assert info.value.field == "cache.file_sha256"
    assert "SHA256SUMS lists cache.safetensors as" in str(info.value)


def test_with_a_trusted_key_every_signature_case_is_refused(
    tmp_path: Path, shop_bundle: Path, tiny_model: Path, monkeypatch
):
    """Issue 18's corpus: altered, foreign, truncated, extra, linked or FIFO signatures and the
    forged bundle are refused by verify, mount and inspect given the trusted key, each with a
    BundleError; the pristine signed bundle is accepted, and the forged one only without a key."""
    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "memo"))
    key, other = generate(), generate()
    key_file = tmp_path / "trusted.pub"
    key_file.write_text(key.public_key().file_text())
    signed = tmp_path / "signed" / "bundles" / "shop" / "1" / shop_bundle.name
    shutil.copytree(shop_bundle, signed)
    sign_bundle(signed, key)
    assert set(decide(signed, tiny_model, key_file).values()) == {"accepted"}
    failures, refused = [], 0
    cases = signature_corpus(signed, key, other)
    for i, case in enumerate(cases):
        bundle = apply(
            case, "raw", signed, tmp_path / f"s{i}" / "bundles" / "shop" / "1" / signed.name
        )
        try:
            decisions = decide(bundle, tiny_model, key_file)
            assert set(decisions.values()) == {"refused"}, f"not refused everywhere: {decisions}"
            refused += 1
        except Exception as exc:  # noqa: BLE001 - anything escaping is a finding to report
            failures.append(f"{case.name}: {exc.__class__.__name__}: {exc}")
        shutil.rmtree(tmp_path / f"s{i}", ignore_errors=True)
    SUMMARY.update(signature_cases=len(cases), signature_refused=refused)
    assert not failures, "\n".join(failures)
    assert len(cases) >= 35
    forge = next(c for c in cases if c.name == "forged-cache")
    forged = apply(
        forge, "raw", signed, tmp_path / "forged" / "bundles" / "shop" / "1" / signed.name
    )
    assert set(decide(forged, tiny_model).values()) == {"accepted"}  # what signatures are for
