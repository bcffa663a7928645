"""One measured thing in a fresh process: `python bench/worker.py TASK '<json args>'`.

Prints one `BENCH-RESULT {json}` line. Peak memory is the RSS peak above a baseline taken after
the imports the task needs, so the figures count only what the measured step added.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.blas import blas_status, ensure_fast_blas

ensure_fast_blas()  # first, in every task: OpenBLAS before anything imports mlx

RESULT_TAG = "BENCH-RESULT "


def max_rss() -> int:
    """Peak resident bytes of this process so far (Linux reports KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def reset_peak() -> int:
    """Reset the peak to the current RSS (Linux clear_refs) and return it: the baseline.

    Without the reset a transient during imports can sit above everything the step adds.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux: the baseline is the peak so far
    return max_rss()


def minor_faults() -> int:
    """Minor page faults so far: each is a first touch of a fresh 4 KiB page."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def emit(result: dict[str, Any]) -> None:
    print(RESULT_TAG + json.dumps(result, sort_keys=True), flush=True)


def task_build(args: dict[str, Any]) -> dict[str, Any]:
    """Our builder as a library call: pipeline.builder.builder.build on one definition."""
    from pipeline.builder.builder import build
    from pipeline.builder.definition import load_definition
    from pipeline.builder.targets import targets
    from pipeline.format.signature import read_trusted_keys

    baseline = reset_peak()
    project = Path(args["project"])
    definition = load_definition(project / "prefixes" / f"{args['name']}.toml", project)
    (target,) = targets(definition, project)
    start = time.perf_counter()
    incremental = args.get("incremental", False)  # a full build unless the case asks
    keys = args.get("trusted_key")  # a parent must be signed by it (then: no recompute)
    result = build(
        target,
        Path(args["bundles"]),
        force=True,
        check=args["check"],
        incremental=incremental,
        trusted_keys=read_trusted_keys([Path(keys)]) if keys else (),
        parent_check=args.get("parent_check", "proven"),
    )
    seconds = time.perf_counter() - start
    m = result.manifest
    return {
        "bundle": str(result.bundle),
        "tokens": m.tokens.count,
        "rendered_tokens": m.tokens.rendered_tokens,
        "dtype": m.cache.dtype,
        "compute_dtype": m.builder.compute_dtype,
        "kv_bits": m.cache.kv_bits,
        "step": m.cache.prefill_step_size,
        "prefill_seconds": result.report["prefill_seconds"],
        "prefill_tok_s": result.report["tokens_per_second"],
        "build_seconds": seconds,
        "fidelity": m.fidelity.model_dump(),
        "blas": blas_status().notice,
        "reused_tokens": result.report["reused_tokens"],
        "parent_seconds": result.report.get("parent_seconds", 0.0),
        "parent_checked": m.parent.checked if m.parent else None,
        "file_sha256": m.cache.file_sha256,
        "rss_baseline": baseline,
        "rss_peak": max_rss(),
    }


def first_token(model: Any, tokens: list[int], cache: list | None, step: int) -> tuple[int, list]:
    """Prefill all but the last token in chunks, then the greedy next token (as mlx_lm does);
    the token and the cache, which then covers all of `tokens`."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = cache if cache is not None else make_prompt_cache(model)
    ids = mx.array(tokens)
    for start in range(0, len(tokens) - 1, step):
        model(ids[start : min(start + step, len(tokens) - 1)][None], cache=cache)
        mx.eval([c.state for c in cache])
    logits = model(ids[-1:][None], cache=cache)[0, -1]
    return int(mx.argmax(logits).item()), cache


def task_ttft(args: dict[str, Any]) -> dict[str, Any]:
    """A restarted server's first request: load the model, mount (or not), answer one token."""
    from mlx_lm import load

    from pipeline.runtime import PromptCacheManager, mount

    stamps = {"imported": time.time()}
    model, tokenizer = load(args["model"])
    stamps["loaded"], faults = time.time(), {"loaded": minor_faults()}
    manager = PromptCacheManager()
    if args.get("bundle"):
        mount(Path(args["model"]), Path(args["bundle"]), manager=manager, model_key="m")
    stamps["mounted"], faults["mounted"] = time.time(), minor_faults()
    if args.get("warm_up"):
        manager.warm_up("m", model)  # what serve --warm-up does once the model is loaded
    stamps["warmed"], faults["warmed"] = time.time(), minor_faults()
    conversation = [*args["messages"], {"role": "user", "content": args["question"]}]
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    tokens = list(tokenizer.encode(text, add_special_tokens=False))
    hit = manager.fetch("m", tokens)
    stamps["fetched"] = time.time()
    token, cache = first_token(model, hit.remaining, hit.cache, args["step"])
    stamps["first_token"], faults["first_token"] = time.time(), minor_faults()
    # the same process's next request, another question after the same prefix: an in-memory hit
    manager.store("m", tokens, cache)  # what serve does after a request (copy-on-write)
    stamps["stored"] = time.time()
    conversation = [*args["messages"], {"role": "user", "content": args["question2"]}]
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    tokens2 = list(tokenizer.encode(text, add_special_tokens=False))
    hit2 = manager.fetch("m", tokens2)
    first_token(model, hit2.remaining, hit2.cache, args["step"])
    stamps["second_token"], faults["second_token"] = time.time(), minor_faults()
    out = {"stamps": stamps, "faults": faults, "token": token, "tokens": len(tokens)}
    return out | {"hit_tokens": hit.cache_hit_tokens, "hit2_tokens": hit2.cache_hit_tokens}


def _mount_verified(args: dict[str, Any]) -> Any:
    from pipeline.runtime import mount

    return mount(Path(args["model"]), Path(args["bundle"]))


def _mount_signed(args: dict[str, Any]) -> Any:
    """A restart mount given a trusted key: the signature stage on top of `verified`."""
    from pipeline.format.signature import read_trusted_keys
    from pipeline.runtime import mount

    keys = read_trusted_keys([Path(args["trusted_key"])])
    args["_start"] = time.perf_counter()  # reading the key file is serve's startup, not the mount
    return mount(Path(args["model"]), Path(args["bundle"]), trusted_keys=keys)


def _mount_first(args: dict[str, Any]) -> Any:
    """The first mount after a deploy: the verify-once memo has no entry for this file yet."""
    import os
    import tempfile

    from pipeline.format import memo

    path = Path(args["bundle"]) / "cache.safetensors"
    entries = memo.table()
    entries.pop(memo.stat_key(path), None)  # keep the weights' entries: a server has those already
    os.environ["PREFIX_BUNDLES_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-memo-")
    for key, digest in entries.items():
        memo.store(key, digest)
    args["_start"] = time.perf_counter()
    return _mount_verified(args)


def _load_unchecked(args: dict[str, Any]) -> Any:
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache

    cache = load_prompt_cache(str(Path(args["bundle"]) / "cache.safetensors"))
    mx.eval([c.state for c in cache])  # mx.load is lazy: count the read, as mount does
    return cache


def _python_read(args: dict[str, Any]) -> Any:
    with open(Path(args["bundle"]) / "cache.safetensors", "rb") as fh:
        return fh.read()


def _read_prefaulted(args: dict[str, Any]) -> Any:
    """Read into memory whose pages were touched before the timer: the copy without page faults."""
    import numpy as np

    buf = np.ones(args["nbytes"], np.uint8)  # filled, so every page is mapped before timing
    args["_start"] = time.perf_counter()
    with open(Path(args["bundle"]) / "cache.safetensors", "rb") as fh:
        fh.readinto(memoryview(buf))
    return buf


def _mount_phases(args: dict[str, Any]) -> Any:
    """mount_one's two parts, timed one by one: the model's fingerprints, then validate + load."""
    from pipeline.format.validate import validate
    from pipeline.runtime.mount import identity_for

    bundle, phases = Path(args["bundle"]), {}
    start = time.perf_counter()
    identity = identity_for(Path(args["model"]))
    phases["fingerprints"] = time.perf_counter() - start
    held = validate(bundle, identity, load=True, trust_memo=True)
    phases["validate_and_load"] = time.perf_counter() - start - sum(phases.values())
    args["_phases"] = phases
    return held


def _sha256(args: dict[str, Any]) -> Any:
    from pipeline.format.fingerprint import sha256_file

    return sha256_file(Path(args["bundle"]) / "cache.safetensors")


def _blake3(args: dict[str, Any]) -> Any:
    """BLAKE3 of the file's bytes already in memory, all cores: the hash part of a first mount."""
    from blake3 import blake3

    data = (Path(args["bundle"]) / "cache.safetensors").read_bytes()
    args["_start"] = time.perf_counter()
    return blake3(data, max_threads=blake3.AUTO).hexdigest()


MOUNT_VARIANTS = {
    "verified": _mount_verified,
    "verified_signed": _mount_signed,
    "verified_first": _mount_first,
    "unchecked": _load_unchecked,
    "python_read": _python_read,
    "read_prefaulted": _read_prefaulted,
    "sha256": _sha256,
    "blake3_in_memory": _blake3,
    "verified_phases": _mount_phases,
}


def task_mount(args: dict[str, Any]) -> dict[str, Any]:
    """One way of getting a bundle's bytes into memory, timed after identical imports."""
    import mlx.core  # noqa: F401  (same imports for every variant: equal baselines)
    import mlx_lm.models.cache  # noqa: F401

    import pipeline.runtime  # noqa: F401

    baseline, faults = reset_peak(), minor_faults()
    start = time.perf_counter()
    held = MOUNT_VARIANTS[args["variant"]](args)
    seconds = time.perf_counter() - args.get("_start", start)
    peak, faults = max_rss(), minor_faults() - faults
    del held
    out = {"seconds": seconds, "rss_baseline": baseline, "rss_peak": peak, "faults": faults}
    return out | ({"phases": args["_phases"]} if "_phases" in args else {})


def task_prefill_ab(args: dict[str, Any]) -> dict[str, Any]:
    """Our prefill loop vs the one cache_prompt runs (generate_step, max_tokens=0), alternating."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from pipeline.builder.definition import CacheSpec
    from pipeline.builder.prefill import encode, load_model, prefill

    step = CacheSpec().prefill_step_size  # the builder's default chunk
    loaded = load_model(Path(args["model"]))
    tokens = encode(loaded.tokenizer, args["text"])

    def ours() -> tuple[float]:
        _, stats = prefill(loaded, tokens, step)
        return (len(tokens) / stats.seconds,)

    def theirs() -> tuple[float, float]:
        marks, start = [], time.time()  # as cache_prompt: wall clock, callback per chunk
        progress = lambda done, total: marks.append((done, time.time() - start))  # noqa: E731
        cache = make_prompt_cache(loaded.model)
        for _ in generate_step(
            mx.array(tokens),
            loaded.model,
            max_tokens=0,
            prompt_cache=cache,
            prompt_progress_callback=progress,
        ):
            pass
        return marks[-1][0] / marks[-1][1], marks[-2][0] / marks[-2][1]

    ours(), theirs()  # warm-up pair: first-call costs of the process go to neither
    out: dict[str, Any] = {"ours": [], "theirs": [], "theirs_chunk": [], "tokens": len(tokens)}
    for i in range(args["pairs"]):
        for fn in (ours, theirs) if i % 2 == 0 else (theirs, ours):
            got = fn()
            if fn is ours:
                out["ours"].append(got[0])
            else:
                out["theirs"].append(got[0])
                out["theirs_chunk"].append(got[1])
    return out


def task_touch(args: dict[str, Any]) -> dict[str, Any]:
    """First-touch cost of fresh anonymous memory in 4 KiB pages (no huge pages, as MLX buffers)."""
    import mmap

    import numpy as np

    nbytes = args["mib"] << 20
    region = mmap.mmap(-1, nbytes)  # plain anonymous mapping: numpy would madvise huge pages
    faults, start = minor_faults(), time.perf_counter()
    np.frombuffer(region, np.uint8).fill(1)
    seconds, faults = time.perf_counter() - start, minor_faults() - faults
    region.close()
    return {"seconds": seconds, "faults": faults, "us_per_page": seconds / (nbytes / 4096) * 1e6}


def task_handout(args: dict[str, Any]) -> dict[str, Any]:
    """The hand-out benchmark (bench/bench_handout.py), with its own markdown table."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_handout

    result = bench_handout.run(args["quick"])
    table = getattr(bench_handout, "table", None)
    return {"result": result, "markdown": table(result) if table else None}


def task_frozen_base(args: dict[str, Any]) -> dict[str, Any]:
    """The frozen-base cache evaluation (bench/frozen_base.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import frozen_base

    result = frozen_base.run(args["model"], args["tokens"])
    return {"result": result, "markdown": frozen_base.table(result)}


TASKS = {
    "build": task_build,
    "ttft": task_ttft,
    "mount": task_mount,
    "prefill_ab": task_prefill_ab,
    "touch": task_touch,
    "handout": task_handout,
    "frozen_base": task_frozen_base,
}

if __name__ == "__main__":
    emit(TASKS[sys.argv[1]](json.loads(sys.argv[2])))
