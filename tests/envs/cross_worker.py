"""One side of the cross-version tests, run by the python of either mlx-lm environment.

  cross_worker.py build PROJECT...          build each project's one definition (check on)
  cross_worker.py check SUFFIX MODEL BUNDLE [MODEL BUNDLE ...]
      per bundle: verify + mount, next-token logits warm vs cold, mlx_lm's own load_prompt_cache

Prints one JSON document on stdout. tests/test_mlx_lm_versions.py compares the two sides.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pipeline  # noqa: F401  (loads OpenBLAS before mlx)


def build(projects: list[str]) -> list[dict]:
    """Build every project (prefixes/<one>.toml) with the fidelity check on."""
    from pipeline.builder.builder import build as build_one
    from pipeline.builder.definition import load_definition
    from pipeline.builder.targets import targets

    out = []
    for root in map(Path, projects):
        (path,) = sorted((root / "prefixes").glob("*.toml"))
        (target,) = targets(load_definition(path, root), root)
        result = build_one(target, root / "bundles", check=True)
        out.append({"bundle": str(result.bundle), "manifest": result.manifest.model_dump()})
    return out


def check_all(suffix: list[int], pairs: list[str]) -> list[dict]:
    """check() and load_prompt_cache() for each (model, bundle) pair."""
    out = []
    for model_dir, bundle in zip(pairs[::2], pairs[1::2], strict=True):
        result = check(model_dir, bundle, suffix)
        result["load_prompt_cache"] = load_prompt_cache(str(Path(bundle) / "cache.safetensors"))
        out.append(result)
    return out


def check(model_dir: str, bundle: str, suffix: list[int]) -> dict:
    """verify (every byte), mount into a PromptCacheManager, then the next-token logits after
    prefix + suffix from the manager's hand-out (warm) and from one cold forward pass."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from pipeline.runtime import PromptCacheManager, mount, verify

    verify(Path(bundle), Path(model_dir))
    manager = PromptCacheManager()
    mounted = mount(Path(model_dir), [Path(bundle)], manager=manager, model_key="m").bundles[0]
    model, _ = load(model_dir)
    tokens = list(mounted.tokens) + suffix
    hit = manager.fetch("m", tokens)
    warm = model(mx.array(hit.remaining)[None], cache=hit.cache)[0, -1]
    cold = model(mx.array(tokens)[None], cache=make_prompt_cache(model))[0, -1]
    return {
        "classes": [type(c).__name__ for c in mounted.cache],
        "hit_tokens": hit.cache_hit_tokens,
        "warm": warm.astype(mx.float32).tolist(),
        "cold": cold.astype(mx.float32).tolist(),
    }


def load_prompt_cache(path: str) -> dict:
    """Whether this mlx-lm's own loader reads the file (what mlx_lm.generate --prompt-cache-file does)."""
    from mlx_lm.models.cache import load_prompt_cache as load_file

    try:
        cache, metadata = load_file(path, return_metadata=True)
    except Exception as exc:  # the answer is the failure itself
        return {"ok": False, "error": f"{exc.__class__.__name__}: {exc}"}
    return {"ok": True, "classes": [type(c).__name__ for c in cache], "keys": sorted(metadata)}


def main(argv: list[str]) -> None:
    from importlib import metadata

    command, args = argv[0], argv[1:]
    if command == "build":
        result = build(args)
    else:
        result = check_all(json.loads(args[0]), args[1:])
    print(json.dumps({"mlx_lm": metadata.version("mlx-lm"), "result": result}))


if __name__ == "__main__":
    main(sys.argv[1:])
