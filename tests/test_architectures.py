"""Every cache kind under test: an architecture x dtype matrix through build, validator and mount.

Per (architecture, dtype) the bundle is built once (with `check.serving = true`, so the serving-path
comparison runs for bfloat16 on a CPU builder too), verified, mounted into a PromptCacheManager, and
continued against a cold prefill in the served dtype, chunked as mlx_lm.server runs a prompt.
"""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from fuzz_corpus import edit_manifest, reseal_sums
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from test_serve import cached, chat, server

from pipeline.format.bundle_folder import MANIFEST_FILE
from pipeline.format.compat import ALLOWED_CACHE_CLASSES
from pipeline.format.errors import BuildError, BundleError
from pipeline.format.manifest import Manifest
from pipeline.runtime import PromptCacheManager, mount, verify
from pipeline.testmodels.arch import DTYPES, generate_arch_model

from conftest import SYSTEM, TOOLS, build_bundle, write_definition

R, K, A, Q = "RotatingKVCache", "KVCache", "ArraysCache", "QuantizedKVCache"
EXPECTED_CLASSES = {
    "qwen3": [K, K],
    "qwen3_moe": [K, K],
    "gemma3_text": [R, R, K],  # window 32, wrapped by the prefix: not trimmable
    "lfm2": [A, K, A],  # conv state: never trimmable
}
QUANTIZED_CLASSES = {  # kv_bits 8: rotating and recurrent layers stay as they are
    "qwen3": [Q, Q],
    "qwen3_moe": [Q, Q],
    "gemma3_text": [R, R, Q],
    "lfm2": None,  # head_dim 16: no group size divides it, the build refuses
}
TRIMMABLE = {"qwen3", "qwen3_moe"}  # the others are reused only by requests extending them whole
CELLS = [(arch, dtype) for arch in EXPECTED_CLASSES for dtype in DTYPES]
SERVER_CHUNK = 2048  # mlx_lm.server's --prefill-step-size default
GREEDY = 8
F32_BOUND = 1e-4
BF16_BOUND = 0.1
QUESTION, FOLLOW_UP = "Where is my order 12345?", "And my order 777?"
# cells built with cache.compute_dtype = "model" (the CPU default, float32, has its own test below)
COMPUTE_IN_MODEL_DTYPE = {("gemma3_text", "bfloat16")}


@functools.cache
def bf16_moe_runs_here() -> bool:
    """MLX's CPU gather_mm (every MoE layer) computes float32 only: a bf16 MoE cannot run there."""
    x = mx.ones((1, 1, 1, 8), dtype=mx.bfloat16)
    try:
        mx.eval(mx.gather_mm(x, mx.ones((2, 8, 8), dtype=mx.bfloat16), rhs_indices=mx.array([[1]])))
    except RuntimeError:
        return False
    return True


@pytest.fixture(scope="module")
def arch_model(tmp_path_factory, tiny_model: Path):
    """(arch, dtype) -> a generated model folder, each generated once per module."""
    made: dict[tuple[str, str], Path] = {}

    def get(arch: str, dtype: str) -> Path:
        if (arch, dtype) not in made:
            out = tmp_path_factory.mktemp("arch") / f"{arch}-{dtype}"
            made[arch, dtype] = generate_arch_model(out, arch, tiny_model, dtype=dtype)
        return made[arch, dtype]

    return get


def build_cell(root: Path, model_dir: Path, arch: str, dtype: str, **cache) -> Path:
    """Build the shop prefix for one cell, the serving-path comparison forced where it can run."""
    forced = not (arch == "qwen3_moe" and dtype == "bfloat16" and not bf16_moe_runs_here())
    if (arch, dtype) in COMPUTE_IN_MODEL_DTYPE:
        cache["compute_dtype"] = '"model"'
    path = write_definition(root, model_dir, **cache)
    if forced:
        path.write_text(path.read_text() + "\n[check]\nserving = true\n")
    return build_bundle(root, check=True)


@dataclass
class Cell:
    arch: str
    dtype: str
    model_dir: Path
    bundle: Path
    manifest: Manifest
    model: Any  # the model as a server computes with it
    tokenizer: Any
    bound: float  # max |dlogit| allowed between warm and cold in the served dtype

    def request(self, *turns: str) -> list[int]:
        """A chat request's tokens, rendered as mlx_lm.server renders it."""
        messages = [{"role": "system", "content": SYSTEM}]
        messages += [{"role": "user", "content": t} for t in turns]
        return list(
            self.tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)
        )

    def mounted(self, manager: PromptCacheManager) -> list[int]:
        result = mount(self.model_dir, self.bundle, manager=manager, model_key="m")
        assert [b.name for b in result.bundles] == ["shop@1"] and not result.refused
        return result.bundles[0].tokens


def served_model(model_dir: Path, arch: str, dtype: str) -> tuple[Any, Any]:
    """The model in its own dtype, as mlx_lm.server runs it (float32 for a bf16 MoE on CPU)."""
    model, tokenizer = load(str(model_dir))
    if arch == "qwen3_moe" and dtype == "bfloat16" and not bf16_moe_runs_here():
        model.set_dtype(mx.float32)  # no server could run it in bf16 here; compare in float32
    return model, tokenizer


def make_cell(root: Path, model_dir: Path, arch: str, dtype: str, **cache) -> Cell:
    bundle = build_cell(root, model_dir, arch, dtype, **cache)
    manifest = verify(bundle, model_dir)
    model, tokenizer = served_model(model_dir, arch, dtype)
    if cache:  # quantized: the recorded bound (0.5 for 8-bit KV)
        bound = manifest.fidelity.threshold
    else:
        bound = F32_BOUND if dtype == "float32" else BF16_BOUND
    return Cell(arch, dtype, model_dir, bundle, manifest, model, tokenizer, bound)


@pytest.fixture(scope="module", params=CELLS, ids=[f"{a}-{d}" for a, d in CELLS])
def cell(request, tmp_path_factory, arch_model) -> Cell:
    arch, dtype = request.param
    root = tmp_path_factory.mktemp(f"{arch}-{dtype}-project")
    return make_cell(root, arch_model(arch, dtype), arch, dtype)


def run(model: Any, cache: list | None, tokens: list[int], steps: int = GREEDY):
    """As mlx_lm.server runs a prompt: all but the last token in chunks, then the last token, then
    greedy decoding. Returns (the first logits as float32, `steps` greedy tokens, the cache)."""
    cache = make_prompt_cache(model) if cache is None else cache
    for start in range(0, len(tokens) - 1, SERVER_CHUNK):
        model(
            mx.array(tokens[start : min(start + SERVER_CHUNK, len(tokens) - 1)])[None], cache=cache
        )
        mx.eval([c.state for c in cache])
    logits = model(mx.array(tokens[-1:])[None], cache=cache)[0, -1].astype(mx.float32)
    first, out = logits, [int(mx.argmax(logits).item())]
    while len(out) < steps:  # the last sampled token is not fed, as in mlx_lm's generate_step
        logits = model(mx.array(out[-1:])[None], cache=cache)[0, -1].astype(mx.float32)
        out.append(int(mx.argmax(logits).item()))
    return first, out, cache


def max_diff(a: mx.array, b: mx.array) -> float:
    return float(mx.max(mx.abs(a - b)).item())


def assert_warm_equals_cold(c: Cell, hit, tokens: list[int]) -> float:
    """The warm continuation within the cell's bound of a cold one; the same greedy tokens unless
    the record says the cold path's top-2 margin is within the difference."""
    warm, warm_tokens, _ = run(c.model, hit.cache, hit.remaining)
    cold, cold_tokens, _ = run(c.model, None, tokens)
    diff = max_diff(warm, cold)
    assert diff <= c.bound, (c.arch, c.dtype, diff)
    serving = c.manifest.fidelity.serving
    if not (serving and serving.tie_within_tolerance):
        assert warm_tokens == cold_tokens
    return diff


# --- 1. Each cell builds, verifies and records the cache classes make_cache() gives ------------


def test_model_loads_in_its_dtype_and_the_bundle_records_its_cache_classes(cell: Cell):
    model, _ = load(str(cell.model_dir))
    config = json.loads((cell.model_dir / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == cell.dtype
    assert {p.dtype for _, p in _params(model)} == {getattr(mx, cell.dtype)}
    made = [type(layer).__name__ for layer in make_prompt_cache(model)]
    assert cell.manifest.cache.classes == made == EXPECTED_CLASSES[cell.arch]
    assert set(made) <= set(ALLOWED_CACHE_CLASSES)  # the validator knows every kind
    assert cell.manifest.cache.dtype == cell.dtype
    assert cell.manifest.tokens.count > 64  # past gemma's window: the rotating buffer wrapped
    f = cell.manifest.fidelity
    assert f.checked and f.max_abs_logit_diff == 0.0 and f.greedy_match  # the builder's own path


def _params(model: Any):
    from mlx.utils import tree_flatten

    return [
        (k, p) for k, p in tree_flatten(model.parameters()) if mx.issubdtype(p.dtype, mx.floating)
    ]


def test_serving_path_is_recorded_within_bounds(cell: Cell):
    f = cell.manifest.fidelity
    if f.serving is None:  # only where the serving path cannot run on this device
        assert cell.arch == "qwen3_moe" and cell.dtype == "bfloat16" and not bf16_moe_runs_here()
        assert f.serving_skipped and "check.serving = true" in f.serving_skipped
        return
    s = f.serving
    assert s.dtype == cell.dtype and s.chunk_tokens == SERVER_CHUNK
    if cell.dtype == "float32":
        assert s.same_as_builder and s.max_abs_logit_diff == 0.0 and s.greedy_match
    elif (cell.arch, cell.dtype) in COMPUTE_IN_MODEL_DTYPE:  # the builder computed as a server
        assert s.same_as_builder and s.max_abs_logit_diff == 0.0 and s.greedy_match
    else:
        assert not s.same_as_builder and 0.0 <= s.max_abs_logit_diff < BF16_BOUND
        assert s.greedy_match or s.tie_within_tolerance
    print(f"measured {cell.arch}-{cell.dtype}: recorded serving diff {s.max_abs_logit_diff:.6g}")


def test_every_layer_is_stored_in_the_served_dtype(cell: Cell):
    from mlx_lm.models.cache import load_prompt_cache

    cache = load_prompt_cache(str(cell.bundle / "cache.safetensors"))
    stored = {type(layer).__name__: _float_dtypes(layer.state) for layer in cache}
    assert all(found == {getattr(mx, cell.dtype)} for found in stored.values()), stored


def _float_dtypes(state: Any) -> set:
    if isinstance(state, mx.array):
        return {state.dtype} if mx.issubdtype(state.dtype, mx.floating) and state.size else set()
    if isinstance(state, list | tuple):
        return set().union(*(_float_dtypes(s) for s in state)) if state else set()
    return set()


def test_a_layer_of_another_kind_is_refused(cell: Cell, tmp_path: Path):
    copy = shutil.copytree(cell.bundle, tmp_path / "b")
    first = EXPECTED_CLASSES[cell.arch][0]
    other = "KVCache" if first != "KVCache" else "RotatingKVCache"
    edit_manifest(lambda m: m["cache"]["classes"].__setitem__(0, other))(copy)
    reseal_sums(copy)
    with pytest.raises(BundleError):
        verify(copy, cell.model_dir)
    assert json.loads((copy / MANIFEST_FILE).read_text())["cache"]["classes"][0] == other


# --- 2. Warm equals cold in the served dtype ------------------------------------------------------


def test_extending_the_whole_prefix_reuses_it_and_continues_like_a_cold_prefill(cell: Cell):
    manager = PromptCacheManager()
    prefix = cell.mounted(manager)
    tokens = cell.request(QUESTION)
    assert tokens[: len(prefix)] == prefix
    hit = manager.fetch("m", tokens)
    assert hit.source == "bundle:shop@1" and hit.cache_hit_tokens == cell.manifest.tokens.count
    diff = assert_warm_equals_cold(cell, hit, tokens)
    print(f"measured {cell.arch}-{cell.dtype}: warm vs cold {diff:.6g}")


# --- 3. Reuse after startup: parting inside the prefix, multi-turn ------------------------------


@pytest.mark.parametrize("where", ["inside-window", "last-token"])
def test_a_request_parting_inside_the_prefix(cell: Cell, where: str):
    manager = PromptCacheManager()
    prefix = cell.mounted(manager)
    at = 10 if where == "inside-window" else len(prefix) - 1
    parting = [*prefix[:at], 27, 872, 198, 13, 42]
    hit = manager.fetch("m", parting)
    if cell.arch in TRIMMABLE:  # trimmed back to where the request parts
        assert hit.cache_hit_tokens == at and hit.remaining == parting[at:]
        assert_warm_equals_cold(cell, hit, parting)
        return
    # rotating past its window / recurrent state: never trimmed, so the request goes cold
    assert hit.cache is None and hit.cache_hit_tokens == 0 and hit.remaining == parting
    served, served_tokens, _ = run(cell.model, hit.cache, hit.remaining)
    cold, cold_tokens, _ = run(cell.model, None, parting)
    assert max_diff(served, cold) == 0.0 and served_tokens == cold_tokens


def test_multi_turn_reuses_the_stored_first_turn(cell: Cell):
    manager = PromptCacheManager()
    prefix = cell.mounted(manager)
    first = cell.request(QUESTION)
    hit = manager.fetch("m", first)
    _, generated, cache = run(cell.model, hit.cache, hit.remaining, steps=4)
    # the last generated token was never fed back: the entry covers first + generated[:-1]
    manager.store("m", [*first, *generated], cache)
    turn = f"<|im_end|>\n<|im_start|>user\n{FOLLOW_UP}<|im_end|>\n<|im_start|>assistant\n"
    second = [*first, *generated, *cell.tokenizer.encode(turn, add_special_tokens=False)]
    again = manager.fetch("m", second)
    assert again.source == "entry"
    assert again.cache_hit_tokens == len(first) + len(generated) - 1 > len(prefix)
    assert_warm_equals_cold(cell, again, second)
    # another first turn: a trimmable entry serves their common prefix, past the bundle's end;
    # a non-trimmable one cannot, and the bundle serves it (untouched by the requests before)
    tokens = cell.request(FOLLOW_UP)
    other = manager.fetch("m", tokens)
    if cell.arch in TRIMMABLE:
        assert other.source == "entry" and other.cache_hit_tokens > len(prefix)
    else:
        assert other.source == "bundle:shop@1" and other.cache_hit_tokens == len(prefix)
    assert_warm_equals_cold(cell, other, tokens)


def test_a_rotating_cache_still_inside_its_window_is_trimmed(tmp_path: Path, tiny_model: Path):
    model_dir = generate_arch_model(
        tmp_path / "gemma-wide", "gemma3_text", tiny_model, sliding_window=1024
    )
    c = make_cell(tmp_path / "project", model_dir, "gemma3_text", "float32")
    assert c.manifest.cache.classes == [R, R, K] and c.manifest.tokens.count < 1024
    manager = PromptCacheManager()
    prefix = c.mounted(manager)
    parting = [*prefix[:200], 27, 872, 198, 13, 42]
    hit = manager.fetch("m", parting)  # every layer trimmable: trimmed back to where it parts
    assert hit.cache_hit_tokens == 200 and hit.remaining == parting[200:]
    assert_warm_equals_cold(c, hit, parting)


# --- 4. Quantized KV (8-bit) where the head_dim allows it ---------------------------------------


@pytest.fixture(scope="module", params=CELLS, ids=[f"{a}-{d}-kv8" for a, d in CELLS])
def quantized(request, tmp_path_factory, arch_model) -> Cell | tuple[str, Path]:
    arch, dtype = request.param
    root = tmp_path_factory.mktemp(f"{arch}-{dtype}-kv8")
    if QUANTIZED_CLASSES[arch] is None:
        return arch, root
    return make_cell(root, arch_model(arch, dtype), arch, dtype, kv_bits=8)


def test_quantized_kv_records_its_quantized_layers_and_holds_its_bound(quantized, arch_model):
    if isinstance(quantized, tuple):  # lfm2: head_dim 16, no KV group size divides it
        arch, root = quantized
        write_definition(root, arch_model(arch, "float32"), kv_bits=8)
        refusal = "KV quantization needs a head_dim divisible by 32: remove cache.kv_bits"
        with pytest.raises(BuildError, match="does not divide the model's head_dim 16") as exc:
            build_bundle(root, check=True)
        assert refusal in str(exc.value)
        return
    c = quantized
    m = c.manifest
    assert m.cache.classes == QUANTIZED_CLASSES[c.arch] and m.cache.kv_bits == 8
    f = m.fidelity
    assert f.threshold == 0.5 and f.max_abs_logit_diff <= f.threshold
    manager = PromptCacheManager()
    c.mounted(manager)
    tokens = c.request(QUESTION)
    hit = manager.fetch("m", tokens)
    assert hit.cache_hit_tokens == m.tokens.count
    warm, _, _ = run(c.model, hit.cache, hit.remaining)
    cold, _, _ = run(c.model, None, tokens)
    diff = max_diff(warm, cold)
    assert diff <= f.threshold
    print(
        f"measured {c.arch}-{c.dtype} kv8: warm vs cold {diff:.4g}, recorded {f.max_abs_logit_diff:.4g}"
    )


# --- 5. The real server: the first request reuses what it reports ------------------------------


@pytest.mark.parametrize(
    "cell",
    [("gemma3_text", "float32"), ("lfm2", "float32")],
    indirect=True,
    ids=["gemma3_text-float32", "lfm2-float32"],
)
def test_first_request_through_serve_reports_its_reuse_and_equals_a_cold_server(
    cell: Cell, tmp_path: Path
):
    bundles = cell.bundle.parents[2]
    with server(cell.model_dir, bundles, tmp_path / "warm.log") as port:
        warm = chat(port, QUESTION)
    assert "1 bundle(s) mounted, 0 refused" in (tmp_path / "warm.log").read_text()
    # not trimmable: reused only whole, so exactly the bundle's tokens
    assert cached(warm) == cell.manifest.tokens.count
    empty = tmp_path / "no-bundles"
    empty.mkdir()
    with server(cell.model_dir, empty, tmp_path / "cold.log") as port:
        cold = chat(port, QUESTION)
    assert cached(cold) == 0
    prompt = len(cell.request(QUESTION))
    assert warm["usage"]["prompt_tokens"] == cold["usage"]["prompt_tokens"] == prompt
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]


# --- Builder cases the matrix once exposed as bugs ---------------------------------------------


def test_a_bf16_sliding_window_model_builds_with_the_default_compute(tmp_path: Path, arch_model):
    model_dir = arch_model("gemma3_text", "bfloat16")
    write_definition(tmp_path, model_dir)
    manifest = verify(build_bundle(tmp_path, check=True), model_dir)  # rotating layers in bf16
    assert manifest.cache.classes == [R, R, K] and manifest.cache.dtype == "bfloat16"


def test_forcing_the_serving_check_for_a_bf16_moe_on_cpu_is_not_a_traceback(
    tmp_path: Path, arch_model
):
    if bf16_moe_runs_here():
        pytest.skip("a bf16 MoE runs on this device: the serving check is measured in the matrix")
    path = write_definition(tmp_path, arch_model("qwen3_moe", "bfloat16"))
    path.write_text(path.read_text() + "\n[check]\nserving = true\n")
    manifest = verify(build_bundle(tmp_path, check=True), arch_model("qwen3_moe", "bfloat16"))
    assert manifest.fidelity.serving is None
    assert manifest.fidelity.serving_skipped.startswith("failed: the serving path cannot run")


def test_the_validator_knows_each_layers_cache_class_from_the_architecture(arch_model):
    from pipeline.format.cache_header import LayoutError, _check_classes
    from pipeline.runtime.mount import identity_for

    classes = identity_for(arch_model("gemma3_text", "float32")).shape.cache_classes
    assert classes == (R, R, K)
    _check_classes([R, R, "QuantizedKVCache"], classes, kv_bits=8)  # KV layers may be quantized
    with pytest.raises(LayoutError, match="layer 0 holds a KVCache but the model builds a Rotat"):
        _check_classes([K, R, K], classes, kv_bits=None)
    with pytest.raises(LayoutError, match="2 cache layers but the model builds 3"):
        _check_classes([R, K], classes, kv_bits=None)
