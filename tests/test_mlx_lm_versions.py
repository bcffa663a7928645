"""mlx-lm minors and their cache-file layouts: a bundle built under one verifies, mounts and
continues as a cold prefill does under the other, both directions, for every cache kind.

The other minor runs in its own virtual environment (tests/envs/make_env.sh; .ci/run makes it
first). Each side runs tests/envs/cross_worker.py: one process builds that side's bundles, one
checks all of them (its own and the other side's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fuzz_corpus import edit_manifest, reseal_sums

from pipeline.format import compat
from pipeline.format.cache_codec import LAYOUTS, read_cache
from pipeline.format.compat import SUPPORTED_RANGE, installed_mlx_lm, layout_for
from pipeline.format.errors import BundleError, PipelineError
from pipeline.runtime import verify
from pipeline.testmodels.arch import generate_arch_model

from conftest import write_definition

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "envs" / "cross_worker.py"
OTHER = {"0.31": "0.32", "0.32": "0.31"}
K, Q, R, A = "KVCache", "QuantizedKVCache", "RotatingKVCache", "ArraysCache"
CELLS = {  # name: (architecture, cache options, the classes the bundle holds)
    "kv": ("qwen3", {}, [K, K]),
    "kv8": ("qwen3", {"kv_bits": 8}, [Q, Q]),
    "rotating": ("gemma3_text", {}, [R, R, K]),  # window 32, wrapped by the prefix
    "arrays": ("lfm2", {}, [A, K, A]),  # conv state
}
BOUND = {"kv8": 0.5}  # the builder's default for 8-bit KV; full precision below
FLOAT_BOUND = 1e-4
SUFFIX = [11, 222, 333, 44]  # token ids after the prefix (vocabulary 1024)
SIDES = ("here", "there")


def minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


@pytest.fixture(scope="module")
def other_python() -> Path:
    """The python of the other supported minor's environment, made once by make_env.sh."""
    other = OTHER[minor(installed_mlx_lm())]
    run = subprocess.run(
        ["bash", str(ROOT / "tests/envs/make_env.sh"), other],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHON": sys.executable},
    )
    if run.returncode != 0:
        why = (run.stderr.strip().splitlines() or ["no output"])[-1]
        message = f"no mlx-lm {other} environment (tests/envs/make_env.sh {other}): {why}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return ROOT / f".venv-mlx-lm-{other}" / "bin" / "python"


def worker(python: Path | str, *args: str) -> tuple[str, object]:
    """Run the worker in one environment; (its mlx-lm version, its result)."""
    run = subprocess.run(
        [str(python), str(WORKER), *args], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(run.stdout.strip().splitlines()[-1])
    return doc["mlx_lm"], doc["result"]


@pytest.fixture(scope="module")
def cross(tmp_path_factory, tiny_model: Path, other_python: Path) -> dict:
    """Build every cell on both sides, then check every bundle on both sides."""
    base = tmp_path_factory.mktemp("versions")
    archs = {arch for arch, _, _ in CELLS.values()}
    models = {a: generate_arch_model(base / "models" / a, a, tiny_model) for a in archs}
    pythons = {"here": sys.executable, "there": other_python}
    out: dict = {"version": {}, "built": {}, "checked": {}}
    for side in SIDES:
        roots = []
        for cell, (arch, cache, _) in CELLS.items():
            roots.append(base / side / cell)
            write_definition(roots[-1], models[arch], **cache)
        version, built = worker(pythons[side], "build", *map(str, roots))
        out["version"][side] = version
        out["built"].update({(side, cell): b for cell, b in zip(CELLS, built, strict=True)})
    pairs = [
        str(x)
        for (_, cell), b in out["built"].items()
        for x in (models[CELLS[cell][0]], b["bundle"])
    ]
    for side in SIDES:
        _, checked = worker(pythons[side], "check", json.dumps(SUFFIX), *pairs)
        for key, result in zip(out["built"], checked, strict=True):
            out["checked"][(*key, side)] = result  # (built by, cell, checked by)
    return out


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def top(logits: list[float]) -> int:
    return max(range(len(logits)), key=logits.__getitem__)


@pytest.mark.slow
def test_the_other_side_runs_the_other_minor(cross):
    here, there = cross["version"]["here"], cross["version"]["there"]
    assert here == installed_mlx_lm()
    assert {minor(here), minor(there)} == {"0.31", "0.32"}


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("side", SIDES)
def test_each_side_writes_and_records_its_own_layout(cross, side, cell):
    built = cross["built"][side, cell]
    layout = layout_for(cross["version"][side])
    assert built["manifest"]["cache"]["layout"] == layout
    assert built["manifest"]["cache"]["classes"] == CELLS[cell][2]
    written = json.loads((Path(built["bundle"]) / "manifest.json").read_text())["cache"]
    # format 3 always writes the layout (format 2 left the 0.32 default out)
    assert written.get("layout") == layout


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize(("built_by", "checked_by"), [("here", "there"), ("there", "here")])
def test_a_bundle_moves_to_the_other_minor_warm_equals_cold(cross, cell, built_by, checked_by):
    built = cross["built"][built_by, cell]
    result = cross["checked"][built_by, cell, checked_by]
    assert result["classes"] == CELLS[cell][2]
    assert result["hit_tokens"] == built["manifest"]["tokens"]["count"]
    assert max_diff(result["warm"], result["cold"]) <= BOUND.get(cell, FLOAT_BOUND)
    assert top(result["warm"]) == top(result["cold"])


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("built_by", SIDES)
def test_a_bundle_continues_alike_under_both_minors(cross, cell, built_by):
    """The same bundle, mounted under 0.31 and under 0.32: the same next-token logits."""
    here = cross["checked"][built_by, cell, "here"]["warm"]
    there = cross["checked"][built_by, cell, "there"]["warm"]
    assert max_diff(here, there) <= FLOAT_BOUND


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS)
def test_mlx_lm_own_loader_reads_only_the_layout_of_its_minor(cross, cell):
    """What `mlx_lm.generate --prompt-cache-file` can read: a bundle built under the same minor
    (documented in docs/bundle-format.md); the two layouts are unreadable to each other's loader."""
    for built_by in SIDES:
        for checked_by in SIDES:
            loaded = cross["checked"][built_by, cell, checked_by]["load_prompt_cache"]
            assert loaded["ok"] == (built_by == checked_by), loaded
            if loaded["ok"]:
                assert loaded["classes"] == CELLS[cell][2]
                assert {"model", "token_ids", "tokenizer_config"} <= set(loaded["keys"])


def snapshot(cache: list) -> list:
    """Each layer's class, offset and state leaves (arrays as numpy), for comparing two caches."""
    import numpy as np
    from mlx.utils import tree_flatten

    def leaf(x):
        return np.array(x) if hasattr(x, "shape") else x

    return [
        (type(c).__name__, getattr(c, "offset", None), [leaf(x) for _, x in tree_flatten(c.state)])
        for c in cache
    ]


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS)
def test_both_minors_write_the_same_arrays_and_read_cache_reads_either(cross, cell):
    """The layouts differ, the data does not: the bare reader (cache_codec.read_cache) gives the
    installed mlx-lm's objects, equal for the file written under 0.31 and under 0.32."""
    import numpy as np

    files = [Path(cross["built"][side, cell]["bundle"]) / "cache.safetensors" for side in SIDES]
    (here, here_meta), (there, there_meta) = map(read_cache, files)
    assert files[0].read_bytes() != files[1].read_bytes()  # two layouts
    assert here_meta == there_meta
    assert [type(c).__name__ for c in here] == CELLS[cell][2]
    a, b = snapshot(here), snapshot(there)
    assert [(k, o) for k, o, _ in a] == [(k, o) for k, o, _ in b]
    count = cross["built"]["here", cell]["manifest"]["tokens"]["count"]
    assert {o for k, o, _ in a if k in (K, Q)} <= {count}
    for (_, _, x), (_, _, y) in zip(a, b, strict=True):
        assert len(x) == len(y)
        assert all(np.array_equal(u, v) for u, v in zip(x, y, strict=True))


# --- the supported range, and what is refused outside it (no second environment) ---------------


def test_pyproject_pins_the_range_compat_claims():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (pin,) = [d for d in project["dependencies"] if d.startswith("mlx-lm")]
    assert pin.split("#")[0].strip() == f"mlx-lm{SUPPORTED_RANGE}"
    assert sorted(LAYOUTS) == sorted(compat.LAYOUT_OF_MINOR.values())


@pytest.mark.parametrize(
    ("version", "layout"),
    [("0.31.0", "mlx-lm-0.31"), ("0.31.3", "mlx-lm-0.31"), ("0.32.2", "mlx-lm-0.32"),
     ("0.30.7", None), ("0.33.0", None), ("1.0.0", None), ("not installed", None)],
)  # fmt: skip
def test_layout_of_each_version(version, layout):
    assert layout_for(version) == layout


def test_an_unsupported_installed_mlx_lm_is_refused_with_range_and_version(
    shop_bundle, tiny_model, monkeypatch
):
    from pipeline.format import validate as validate_module

    monkeypatch.setattr(validate_module, "installed_mlx_lm", lambda: "0.33.0")
    with pytest.raises(BundleError) as refused:
        verify(shop_bundle, tiny_model)
    assert refused.value.reason == (
        "installed mlx-lm 0.33.0 is outside the supported range >=0.31,<0.33; "
        "install a supported one: pip install 'mlx-lm>=0.31,<0.33'"
    )
    monkeypatch.setattr(compat, "installed_mlx_lm", lambda: "0.30.7")
    with pytest.raises(PipelineError, match=r"^installed mlx-lm 0.30.7 is outside the supported"):
        compat.installed_layout()


def test_the_builder_refuses_an_unsupported_mlx_lm_before_the_prefill(monkeypatch):
    import mlx_lm

    from pipeline.builder.builder import builder_info
    from pipeline.format.errors import BuildError

    monkeypatch.setattr(mlx_lm, "__version__", "0.33.1")
    with pytest.raises(BuildError) as refused:
        builder_info()
    assert str(refused.value) == (
        "installed mlx-lm 0.33.1 is outside the supported range >=0.31,<0.33; "
        "install a supported one: pip install 'mlx-lm>=0.31,<0.33'"
    )


HERE = layout_for(installed_mlx_lm()) or "mlx-lm-0.32"
THERE, THERE_VERSION = {
    "mlx-lm-0.31": ("mlx-lm-0.32", "0.32.2"),
    "mlx-lm-0.32": ("mlx-lm-0.31", "0.31.3"),
}[HERE]


@pytest.mark.parametrize(
    ("updates", "message"),
    [
        (
            {"cache": {"layout": THERE}},
            f"cache.layout {THERE} is not the layout mlx-lm {installed_mlx_lm()} writes ({HERE}); "
            "rebuild the bundle",
        ),
        (
            {"cache": {"layout": THERE}, "builder": {"mlx_lm": THERE_VERSION}},
            f"cache.safetensors is in the {HERE} layout but the manifest records {THERE}; "
            "rebuild the bundle",
        ),
        (
            {"builder": {"mlx_lm": "0.30.7"}},
            "it was built with mlx-lm 0.30.7, outside the supported range >=0.31,<0.33; "
            "rebuild it under a supported mlx-lm",
        ),
        (
            {"cache": {"layout": "mlx-lm-0.33"}},
            "manifest.json is invalid at cache.layout: Input should be 'mlx-lm-0.31' or "
            "'mlx-lm-0.32'; rebuild the bundle",
        ),
    ],
    ids=[
        "layout-not-the-builders",
        "file-claimed-as-the-other-layout",
        "built-by-an-unsupported-mlx-lm",
        "unknown-layout",
    ],
)
def test_a_manifest_claiming_another_layout_is_refused(
    shop_bundle, tiny_model, tmp_path, updates, message
):
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(shop_bundle, bundle)
    edit_manifest(lambda m: [m[part].update(values) for part, values in updates.items()] and None)(
        bundle
    )
    reseal_sums(bundle)
    with pytest.raises(BundleError) as refused:
        verify(bundle, tiny_model)
    assert refused.value.reason == message
