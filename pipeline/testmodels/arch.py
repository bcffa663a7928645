"""Tiny real-format model folders of mlx_lm architectures, for every cache kind under test.

The weights are the architecture's own initialisation under a fixed seed, saved as safetensors in
float32 or cast to bfloat16 (config `torch_dtype`/`dtype` say which); the tokenizer and chat
template are the tiny Qwen3 test model's. Small enough to build in well under a second.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
DTYPES = ("float32", "bfloat16")
COMMON = {
    "vocab_size": 1024,
    "bos_token_id": 1015,
    "eos_token_id": 1017,
    "tie_word_embeddings": True,
}
CONFIGS = {
    # plain attention with per-head q/k RMSNorm: one KVCache per layer
    "qwen3": dict(
        model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, head_dim=64, num_key_value_heads=2, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=4096,
    ),
    # mixture of experts (4 tiny experts, top 2, q/k norms): one KVCache per layer
    "qwen3_moe": dict(
        model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, head_dim=64, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
        moe_intermediate_size=32, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=4096,
    ),
    # sliding window 32 < the test prefix: layers 0 and 1 wrap a RotatingKVCache, layer 2 is global
    "gemma3_text": dict(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
        num_attention_heads=4, head_dim=64, num_key_value_heads=2, sliding_window=32,
        sliding_window_pattern=3, max_position_embeddings=4096, query_pre_attn_scalar=64,
    ),
    # hybrid: conv state in ArraysCache (layers 0, 2) and one attention layer (KVCache)
    "lfm2": dict(
        model_type="lfm2", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, norm_eps=1e-5, conv_bias=False,
        conv_L_cache=3, block_dim=64, block_multiple_of=32, block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False, block_ff_dim=128, full_attn_idxs=[1],
    ),
}  # fmt: skip


def generate_arch_model(
    out_dir: Path,
    arch: str,
    tokenizer_from: Path,
    seed: int = 0,
    dtype: str = "float32",
    **overrides,
) -> Path:
    """Write config.json, model.safetensors (in `dtype`) and the tokenizer files for `arch`;
    `overrides` replace config fields (e.g. sliding_window=1024)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {**CONFIGS[arch], **COMMON, **overrides, "torch_dtype": dtype, "dtype": dtype}
    for name in TOKENIZER_FILES:
        shutil.copy(Path(tokenizer_from) / name, out_dir / name)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    target = getattr(mx, dtype)
    weights = {
        k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in weights.items()
    }
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights)
    return out_dir
