"""Tiny real-format model folders of other mlx_lm architectures, for every cache kind under test.

The weights are the architecture's own initialisation under a fixed seed, saved as safetensors; the
tokenizer and chat template are the tiny Qwen3 test model's. Small enough to build in a second.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
COMMON = {
    "vocab_size": 1024,
    "bos_token_id": 1015,
    "eos_token_id": 1017,
    "tie_word_embeddings": True,
}
CONFIGS = {
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


def generate_arch_model(out_dir: Path, arch: str, tokenizer_from: Path, seed: int = 0) -> Path:
    """Write config.json, model.safetensors and the tokenizer files for `arch` into out_dir."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {**CONFIGS[arch], **COMMON}
    for name in TOKENIZER_FILES:
        shutil.copy(Path(tokenizer_from) / name, out_dir / name)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.save_safetensors(str(out_dir / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return out_dir
