"""Deterministic generator of a real-format Qwen3 model folder with random weights."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.format.errors import ModelError, PipelineError
from pipeline.testmodels.tokenizer import (
    EOS,
    MARKUP,
    PAD,
    SPECIAL,
    tokenizer_config,
    train_tokenizer,
)

SIZES = ("tiny", "small", "bench")  # keys of SPECS
DTYPES = {"float32": ("F32", 4), "bfloat16": ("BF16", 2), "float16": ("F16", 2)}  # safetensors
GENERATOR_VERSION = 1
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


@dataclass(frozen=True)
class Spec:
    """Shapes and defaults of one generated model size."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int | None  # embedding rows (padded as in Qwen); None: the tokenizer's vocabulary
    tokenizer_vocab: int
    dtype: str
    # std of weight matrices (embeddings: 0.02). At 0.02 the tiny model's residual stream is
    # mostly the embedding and greedy decoding repeats the last token forever.
    std: float


SPECS = {
    # head_dim 64 so 8- and 4-bit KV quantization (group size 64) works on the tiny model too
    "tiny": Spec(2, 64, 4, 2, 64, 128, None, 1024, "float32", 0.125),
    # `just bench --quick`: the bench model's family and tokenizer, small enough to run every case fast
    "small": Spec(4, 256, 4, 2, 64, 768, None, 8192, "bfloat16", 0.02),
    "bench": Spec(28, 1024, 16, 8, 128, 3072, 151936, 8192, "bfloat16", 0.02),
}
CHUNK_ELEMENTS = 1 << 23  # rows are generated and written in chunks of about this many values


def model_config(size: str, vocab_size: int, dtype: str | None = None) -> dict:
    """The config.json of a generated model; `vocab_size` is the tokenizer's."""
    spec = SPECS[size]
    dtype = dtype or spec.dtype
    pad, eos = vocab_size - len(SPECIAL) - len(MARKUP), vocab_size - len(MARKUP) - 1
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "bos_token_id": pad,
        "dtype": dtype,
        "eos_token_id": eos,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "max_position_embeddings": 40960,
        "model_type": "qwen3",
        "num_attention_heads": spec.heads,
        "num_hidden_layers": spec.layers,
        "num_key_value_heads": spec.kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "torch_dtype": dtype,
        "use_cache": True,
        "vocab_size": spec.vocab or vocab_size,
    }


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every weight of a Qwen3 model with tied embeddings, sorted by name."""
    hidden, head_dim, inter = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    per_layer = {
        "input_layernorm.weight": (hidden,),
        "mlp.down_proj.weight": (hidden, inter),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.k_norm.weight": (head_dim,),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, q),
        "self_attn.q_norm.weight": (head_dim,),
        "self_attn.q_proj.weight": (q, hidden),
        "self_attn.v_proj.weight": (kv, hidden),
    }
    shapes = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in per_layer.items()})
    return dict(sorted(shapes.items()))


def _rng(seed: int, name: str) -> np.random.Generator:
    # One stream per tensor, keyed by its name, so no tensor depends on the order of the others.
    key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, key])))


def _tensor_chunks(
    shape: tuple[int, ...], rng: np.random.Generator, live_rows: int, std: float
) -> Iterator[np.ndarray]:
    """Yield a tensor's float32 values in row chunks: ones for norms, N(0, std) for matrices."""
    if len(shape) == 1:
        yield np.ones(shape, np.float32)
        return
    rows, cols = shape
    step = max(1, CHUNK_ELEMENTS // cols)
    for start in range(0, rows, step):
        chunk = np.zeros((min(step, rows - start), cols), np.float32)
        live = chunk[: max(0, live_rows - start)]  # padded embedding rows stay zero
        rng.standard_normal(out=live, dtype=np.float32)
        live *= std
        yield chunk


def _encode(values: np.ndarray, dtype: str) -> np.ndarray:
    """Cast float32 values to the stored dtype (bfloat16: round to nearest even on the bits)."""
    if dtype == "float32":
        return values.astype("<f4", copy=False)
    if dtype == "float16":
        return values.astype("<f2")
    bits = values.view(np.uint32)
    bits += 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).astype("<u2")


def _header(shapes: dict[str, tuple[int, ...]], dtype: str) -> bytes:
    """The safetensors header (length prefix included) for tensors stored in this order."""
    code, itemsize = DTYPES[dtype]
    header, offset = {}, 0
    for name, shape in shapes.items():
        end = offset + int(np.prod(shape)) * itemsize
        header[name] = {"data_offsets": [offset, end], "dtype": code, "shape": list(shape)}
        offset = end
    header["__metadata__"] = {"format": "mlx"}
    blob = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return len(blob).to_bytes(8, "little") + blob


def write_weights(path: Path, config: dict, seed: int, *, live_vocab: int, std: float) -> None:
    """Write model.safetensors tensor by tensor, so memory stays at about one chunk."""
    shapes = tensor_shapes(config)
    with open(path, "wb") as f:
        f.write(_header(shapes, config["dtype"]))
        for name, shape in shapes.items():
            embed = name == "model.embed_tokens.weight"
            rows, scale = (live_vocab, 0.02) if embed else (shape[0], std)
            for chunk in _tensor_chunks(shape, _rng(seed, name), rows, scale):
                f.write(_encode(chunk, config["dtype"]))


def _dump(obj: dict) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _write_folder(folder: Path, params: dict) -> None:
    """Write every file of the model folder into `folder`."""
    spec = SPECS[params["size"]]
    tokenizer = train_tokenizer(spec.tokenizer_vocab)
    vocab_size = tokenizer.get_vocab_size()
    config = model_config(params["size"], vocab_size, params["dtype"])
    eos, pad = config["eos_token_id"], config["bos_token_id"]
    if (tokenizer.id_to_token(eos), tokenizer.id_to_token(pad)) != (EOS, PAD):
        raise RuntimeError(f"bug: test tokenizer ids {eos}, {pad} are not {EOS}, {PAD}")
    files = {
        "config.json": _dump(config),
        "generation_config.json": _dump(
            {"bos_token_id": pad, "eos_token_id": [eos, pad], "pad_token_id": pad}
        ),
        "special_tokens_map.json": _dump({"eos_token": EOS, "pad_token": PAD}),
        "tokenizer.json": tokenizer.to_str(pretty=True) + "\n",
        "tokenizer_config.json": _dump(tokenizer_config()),
    }
    for name, text in files.items():
        (folder / name).write_bytes(text.encode())  # no newline translation, on any OS
    write_weights(
        folder / "model.safetensors", config, params["seed"], live_vocab=vocab_size, std=spec.std
    )
    (folder / "generator.json").write_bytes(_dump(params).encode())


def _parameters(size: str, seed: int, dtype: str | None) -> dict:
    if size not in SIZES:
        raise ModelError(f"unknown test model size {size!r}; choose one of {', '.join(SIZES)}")
    if dtype is not None and dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if not isinstance(seed, int) or seed < 0:
        raise ModelError(f"seed must be a non-negative integer, got {seed!r}")
    dtype = dtype or SPECS[size].dtype
    return {"dtype": dtype, "generator_version": GENERATOR_VERSION, "seed": seed, "size": size}


def _existing(out_dir: Path, params: dict) -> Path:
    """Return out_dir when it already holds this exact model, else refuse to touch it."""
    try:
        found = json.loads((out_dir / "generator.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        found = None
    if found == params and all((out_dir / name).is_file() for name in FILES):
        return out_dir
    wanted = f"size={params['size']} seed={params['seed']} dtype={params['dtype']}"
    raise ModelError(
        f"cannot generate the test model into {out_dir}: it exists and is not the model "
        f"{wanted}; delete it or choose another folder"
    )


def generate_model(
    out_dir: Path, size: str = "tiny", *, seed: int = 0, dtype: str | None = None
) -> Path:
    """Generate (or reuse) a deterministic Qwen3-format model folder and return its path."""
    params, out_dir = _parameters(size, seed, dtype), Path(out_dir)
    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())):
        return _existing(out_dir, params)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as exc:  # name the folder asked for, not the temporary one
        raise PipelineError(
            f"cannot create the model folder {out_dir}: {exc.strerror}; choose a writable folder"
        ) from None
    try:
        _write_folder(tmp, params)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not out_dir.exists():
                raise
            return _existing(out_dir, params)  # another process finished first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    """Command line: python -m pipeline.testmodels.model [--size S] [--seed N] [--dtype D] OUT_DIR."""
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.testmodels.model", description=__doc__
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None)
    args = parser.parse_args(argv)
    try:
        print(generate_model(args.out_dir, args.size, seed=args.seed, dtype=args.dtype))
    except ModelError as exc:
        parser.exit(1, f"Error: {exc}\n")


if __name__ == "__main__":
    main()
