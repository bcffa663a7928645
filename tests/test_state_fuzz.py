"""Every cache-state field of every cache kind, edited with every pin rewritten (issue 22, 2-3).

An attacker who can write an unsigned bundle can rewrite the manifest's pins and SHA256SUMS, so
integrity proves nothing about the state itself: the validator must derive every state tensor's
shape and every meta-state value (offset, keep, max_size, _idx, group size, bits, conv state) from
the model and the manifest. Per kind, each scalar is set to its neighbours and to 0, and each state
array grows or shrinks by one along each axis (data rewritten to match, manifest nbytes and file
pins rewritten, sums regenerated). Each case must be refused by verify, mount and inspect alike, or
accepted with next-token logits bit-identical to the pristine bundle's.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest
from fuzz_corpus import reseal_manifest
from mlx_lm import load
from test_fuzz import decide
from test_serve_cache_kinds import KINDS

from pipeline.format.bundle_folder import CACHE_FILE, MANIFEST_FILE
from pipeline.format.errors import BundleError
from pipeline.runtime import PromptCacheManager, mount, verify
from pipeline.testmodels.arch import generate_arch_model

from conftest import build_bundle, write_definition

FUZZED = ("full", "8-bit", "rotating", "rotating-8-bit", "hybrid", "hybrid-8-bit")
Edit = Callable[[dict, dict], None]  # (arrays, metadata) -> None, in place


def state_edits(arrays: dict, metadata: dict) -> dict[str, Edit]:
    """name -> edit, for every scalar state entry and every state array of the file."""
    edits: dict[str, Edit] = {}
    scalar_names = [v for k, v in metadata.items() if re.fullmatch(r"2\.\d+\.0", k)]
    for name in scalar_names:  # mlx-lm 0.32 keeps meta-state in 0-d int32 tensors
        value = arrays[name].item() if arrays[name].ndim == 0 else None
        if value is None:
            continue
        for label, new in {
            "plus-1": value + 1,
            "minus-1": value - 1,
            "zero": 0,
            "huge": 1 << 20,
        }.items():
            if new != value:
                edits[f"scalar-{name}-{label}"] = lambda a, m, n=name, v=new: a.update(
                    {n: mx.array(v, dtype=mx.int32)}
                )
    for key, text in metadata.items():  # mlx-lm 0.31 keeps it in the metadata
        if re.fullmatch(r"0\.\d+\.\d+", key) and text.isdigit():
            for label, new in {"plus-1": int(text) + 1, "zero": 0}.items():
                if new != int(text):
                    edits[f"meta-{key}-{label}"] = lambda a, m, k=key, v=new: m.update({k: str(v)})
    for name, array in arrays.items():
        if array.ndim == 0 or array.size == 0:
            continue
        for axis in range(array.ndim):
            edits[f"array-{name}-axis{axis}-grow"] = lambda a, m, n=name, x=axis: a.update(
                {n: _grow(a[n], x)}
            )
            if array.shape[axis] > 1:
                edits[f"array-{name}-axis{axis}-shrink"] = lambda a, m, n=name, x=axis: a.update(
                    {n: _shrink(a[n], x)}
                )
    return edits  # fmt: skip


def _grow(array: mx.array, axis: int) -> mx.array:
    """One more slice along `axis`: a copy of the last one (plausible data, not zeros)."""
    last = mx.take(array, mx.array([array.shape[axis] - 1]), axis=axis)
    return mx.concatenate([array, last], axis=axis)


def _shrink(array: mx.array, axis: int) -> mx.array:
    return mx.take(array, mx.arange(array.shape[axis] - 1), axis=axis)


def rewrite(bundle: Path, edit: Edit) -> None:
    """Apply `edit` to the cache file's arrays and metadata, then rewrite nbytes and every pin."""
    arrays, metadata = mx.load(str(bundle / CACHE_FILE), return_metadata=True)
    edit(arrays, metadata)
    mx.save_safetensors(str(bundle / CACHE_FILE), arrays, metadata)
    scalars = {v for k, v in metadata.items() if re.fullmatch(r"2\.\d+\.0", k)}
    manifest = json.loads((bundle / MANIFEST_FILE).read_text())
    manifest["cache"]["nbytes"] = sum(a.nbytes for n, a in arrays.items() if n not in scalars)
    (bundle / MANIFEST_FILE).write_text(json.dumps(manifest, sort_keys=True, indent=2) + "\n")
    reseal_manifest(bundle)


_MADE: dict[str, tuple] = {}


def make_kind(name: str, tmp_path_factory, tiny_model: Path) -> tuple:
    """(name, model folder, pristine bundle, served model, request tokens, pristine logits),
    made once per kind."""
    if name not in _MADE:
        arch, dtype, overrides, cache, _ = KINDS[name]
        root = tmp_path_factory.mktemp(f"state-{name}")
        model_dir = generate_arch_model(root / "model", arch, tiny_model, dtype=dtype, **overrides)
        write_definition(root, model_dir, **cache)
        bundle = build_bundle(root)
        model, _ = load(str(model_dir))
        tokens = [*mount(model_dir, bundle).bundles[0].tokens, 27, 872, 198, 13, 42]
        logits = next_logits(model, model_dir, bundle, tokens)
        _MADE[name] = (name, model_dir, bundle, model, tokens, logits)
    return _MADE[name]


@pytest.fixture(scope="module", params=FUZZED)
def kind(request, tmp_path_factory, tiny_model: Path):
    return make_kind(request.param, tmp_path_factory, tiny_model)


def next_logits(model, model_dir: Path, bundle: Path, tokens: list[int]) -> mx.array:
    manager = PromptCacheManager()
    assert mount(model_dir, [bundle], manager=manager, model_key="m").bundles
    hit = manager.fetch("m", tokens)
    logits = model(mx.array(hit.remaining)[None], cache=hit.cache)[0, -1]
    mx.eval(logits)
    return logits


def test_every_state_field_is_refused_or_identical(kind, tmp_path: Path, monkeypatch):
    name, model_dir, pristine, model, tokens, pristine_logits = kind
    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "memo"))
    arrays, metadata = mx.load(str(pristine / CACHE_FILE), return_metadata=True)
    edits = state_edits(arrays, metadata)
    resaved = tmp_path / "resaved" / "b"  # the harness itself: a rewrite with no edit is accepted
    shutil.copytree(pristine, resaved)
    rewrite(resaved, lambda a, m: None)
    assert verify(resaved, model_dir)
    failures, refused, identical = [], 0, 0
    for i, (label, edit) in enumerate(edits.items()):
        bundle = tmp_path / f"c{i}" / "b"
        shutil.copytree(pristine, bundle)
        try:
            rewrite(bundle, edit)
            decisions = decide(bundle, model_dir)
            assert len(set(decisions.values())) == 1, f"decisions differ: {decisions}"
            if decisions["verify"] == "refused":
                refused += 1
            else:
                logits = next_logits(model, model_dir, bundle, tokens)
                assert mx.array_equal(logits, pristine_logits).item(), "accepted, output changed"
                identical += 1
        except Exception as exc:  # noqa: BLE001 - anything escaping is a finding to report
            failures.append(f"{name} {label}: {exc.__class__.__name__}: {str(exc)[:300]}")
        shutil.rmtree(bundle.parent, ignore_errors=True)
    assert not failures, "\n".join(failures)
    assert refused + identical == len(edits) and len(edits) >= 10


@pytest.mark.parametrize("name", ["rotating", "hybrid"])
def test_the_issues_rotating_and_conv_states_are_refused_naming_the_field(
    tmp_path: Path, tmp_path_factory, tiny_model: Path, name: str
):
    """keep 5, _idx 7 and keep 40 on the rotating window; a (1, 5, 64) conv state on lfm2."""
    _, model_dir, pristine, *_ = make_kind(name, tmp_path_factory, tiny_model)
    edits = (
        {"keep-5": ("0.3", 5), "idx-7": ("0.5", 7), "keep-40": ("0.3", 40)}
        if name == "rotating"
        else {"conv-1-5-64": ("0.0.0", None)}
    )
    for label, (entry, value) in edits.items():
        bundle = tmp_path / label / "b"
        shutil.copytree(pristine, bundle)
        if value is None:
            edit = lambda a, m, e=entry: a.update({e: mx.zeros((1, 5, 64), a[e].dtype)})  # noqa: E731
        else:
            edit = lambda a, m, e=entry, v=value: a.update({e: mx.array(v, dtype=mx.int32)})  # noqa: E731
        rewrite(bundle, edit)
        with pytest.raises(BundleError) as info:
            verify(bundle, model_dir)
        assert info.value.check == "layout" or info.value.check == "data", str(info.value)
        assert f"{entry}" in str(info.value), str(info.value)
