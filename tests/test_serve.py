"""End to end: the real mlx_lm.server started by `build.py serve`, over loopback HTTP."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.format.bundle_folder import MANIFEST_FILE
from pipeline.format.errors import PipelineError

from conftest import SYSTEM, TOOLS

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(model: Path, bundles: Path, log: Path):
    with server_process(model, bundles, log) as (_, port):
        yield port


@contextmanager
def server_process(
    model: Path, bundles: Path, log: Path, *extra: str, entry: Path = ROOT / "build.py", **popen
):
    """`build.py serve` (with extra options; `entry`: another script taking build.py's arguments;
    `popen`: env, preexec_fn, ...) and its port, once it answers /health."""
    port = free_port()
    args = [
        sys.executable,
        str(entry),
        "serve",
        "--model",
        str(model),
        "--bundles",
        str(bundles),
        "--port",
        str(port),
        "--max-tokens",
        "12",
        *extra,
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, **popen)
        try:
            wait_ready(port, proc, log)
            yield proc, port
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def wait_ready(port: int, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {log.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"server not ready: {log.read_text()}")


def chat(port: int, question: str, system: str | None = SYSTEM, **extra) -> dict:
    """One chat completion at temperature 0: the system text (none if None), the tools, a question;
    `extra` adds or overrides body fields (seed, logprobs, top_k, ...)."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    body = {
        "messages": [*messages, {"role": "user", "content": question}],
        "tools": TOOLS,
        "max_tokens": 12,
        "temperature": 0.0,
        **extra,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def cached(response: dict) -> int:
    return response["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


@pytest.mark.slow
def test_first_request_after_start_is_warm_and_equals_cold(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path
):
    prefix_tokens = json.loads((shop_bundle / MANIFEST_FILE).read_text())["tokens"]["count"]
    bundles = shop_bundle.parents[2]
    with server(tiny_model, bundles, tmp_path / "warm.log") as port:
        warm = chat(port, "Where is my order 12345?")
    log = (tmp_path / "warm.log").read_text()
    assert "mounted shop@1" in log and "1 bundle(s) mounted, 0 refused" in log
    assert "warmed up from shop@1" in log  # on by default
    assert cached(warm) >= prefix_tokens - 1

    empty = tmp_path / "no-bundles"
    empty.mkdir()
    with server(tiny_model, empty, tmp_path / "cold.log") as port:
        cold = chat(port, "Where is my order 12345?")
    assert cached(cold) == 0
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    assert warm["usage"]["prompt_tokens"] == cold["usage"]["prompt_tokens"]

    with server(tiny_model, bundles, tmp_path / "restart.log") as port:
        again = chat(port, "Where is my order 12345?")
        later = chat(port, "And my order 777?")
    assert cached(again) >= prefix_tokens - 1 and again["choices"] == warm["choices"]
    assert cached(later) >= prefix_tokens - 1

    with server_process(tiny_model, bundles, tmp_path / "cool.log", "--no-warm-up") as (_, port):
        unwarmed = chat(port, "Where is my order 12345?")
    assert "warmed up" not in (tmp_path / "cool.log").read_text()
    assert unwarmed["choices"] == warm["choices"] and cached(unwarmed) == cached(warm)


@pytest.mark.slow
def test_refused_bundle_is_logged_and_skipped(
    shop_bundle: Path, tiny_model_other_weights: Path, tmp_path: Path
):
    with server(tiny_model_other_weights, shop_bundle.parents[2], tmp_path / "s.log") as port:
        response = chat(port, "Hello?")
    log = (tmp_path / "s.log").read_text()
    assert "refused" in log and "model weights/config mismatch" in log
    assert cached(response) == 0


@pytest.mark.slow
def test_serve_mounts_the_newest_version_and_survives_a_broken_bundle(
    tiny_model: Path, tmp_path: Path
):
    from conftest import build_bundle, write_definition

    path = write_definition(tmp_path, tiny_model)
    build_bundle(tmp_path)
    path.write_text(path.read_text().replace("version = 1", "version = 2"))
    v2 = build_bundle(tmp_path)
    broken = tmp_path / "bundles" / "zz" / "1" / v2.name
    shutil.copytree(v2, broken)
    (broken / "cache.safetensors").write_bytes(b"\xff" * 64)  # a header no parser accepts
    prefix_tokens = json.loads((v2 / MANIFEST_FILE).read_text())["tokens"]["count"]
    with server(tiny_model, tmp_path / "bundles", tmp_path / "s.log") as port:
        response = chat(port, "Where is my order 12345?")
    log = (tmp_path / "s.log").read_text()
    assert "mounted shop@2" in log and "mounted shop@1" not in log
    assert "not mounted: older version" in log and f"refused {broken}" in log
    assert (
        "1 bundle(s) mounted, 1 refused, 0 not usable with the server's options, 1 older version(s) not mounted"
        in log
    )
    assert cached(response) >= prefix_tokens - 1


DEATH = re.compile(
    r"generation thread died \(RuntimeError: injected fault: the sampler raised for top_k 13 "
    r"at faulty_serve\.py:\d+\)"
)
# A fault inside mlx_lm's generation thread, injected the way a sampler bug would raise: the driver
# patches mlx_lm's own top-k step, then runs build.py's main (serve, the real server) unchanged.
FAULTY_SERVE = """import sys
import mlx_lm.sample_utils as sample_utils
real_top_k = sample_utils.apply_top_k
def apply_top_k(logprobs, top_k):
    if top_k == 13:
        raise RuntimeError("injected fault: the sampler raised for top_k 13")
    return real_top_k(logprobs, top_k)
sample_utils.apply_top_k = apply_top_k
from pipeline.cli import main
sys.exit(main(sys.argv[1:]))
"""


def ignore_sigint() -> None:
    """As a script's background job starts: SIGINT ignored, so Python installs no handler."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.slow
@pytest.mark.parametrize("sigint", ["handled", "ignored"])
def test_a_dead_generation_thread_ends_serve_with_status_1(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path, sigint: str
):
    # Before, the process stayed up and answered 404 to every request once the thread was gone.
    log, entry = tmp_path / "s.log", tmp_path / "faulty_serve.py"
    entry.write_text(FAULTY_SERVE)
    popen = {"preexec_fn": ignore_sigint} if sigint == "ignored" else {}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with server_process(tiny_model, shop_bundle.parents[2], log, entry=entry, env=env, **popen) as (
        proc,
        port,
    ):
        with pytest.raises(OSError):  # the connection drops (or errors): no answer
            chat(port, "Hello?", temperature=1.0, top_k=13)
        start = time.monotonic()
        assert proc.wait(timeout=60) == 1
        assert time.monotonic() - start < 5  # not the 10 s grace period's hard exit
    lines = log.read_text().splitlines()
    died = [line for line in lines if DEATH.search(line)]
    assert died[0].endswith("; serve exits with status 1")
    if sigint == "handled":  # the HTTP server stopped, then the CLI's one error line
        assert len(died) == 2 and died[1] == lines[-1]
        assert lines[-1].startswith("error: mlx_lm.server's generation thread died (")
        assert lines[-1].endswith("; serve stopped so that a service manager restarts it")
    else:  # no way to interrupt the main thread: exited at once, the log line is the last
        assert len(died) == 1 and died[0] == lines[-1]
    assert "Traceback" not in log.read_text()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"top_k": 100_000}, "top_k must be below the model's vocabulary size 1024, got 100000"),
        (
            {"xtc_probability": 0.5, "xtc_threshold": 0.7},
            "xtc_threshold must be in [0, 0.5] when xtc_probability > 0, got 0.7",
        ),
        (  # MLX's scatter past the vocabulary crashed the process (SIGSEGV; outside review)
            {"logit_bias": {"99999999": 5}},
            "logit_bias token ids must be in [0, 1024) (the vocabulary), got 99999999",
        ),
    ],
    ids=["top_k", "xtc_threshold", "logit_bias"],
)
def test_a_request_mlx_lm_would_fail_in_its_thread_is_refused_alone(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path, fields: dict, problem: str
):
    # mlx_lm.server accepts these settings and raises on them only while sampling, inside the
    # generation thread shared by every request; serve refuses them up front, for this request.
    log = tmp_path / "s.log"
    with server_process(tiny_model, shop_bundle.parents[2], log) as (proc, port):
        with pytest.raises(urllib.error.HTTPError) as refused:
            chat(port, "Hello?", temperature=1.0, **fields)
        assert json.loads(refused.value.read()) == {"error": problem}
        assert chat(port, "Hello?")["choices"][0]["message"]  # the server still answers
        assert chat(port, "Hello?", temperature=1.0, top_k=5)["choices"]  # valid sampling works
        assert proc.poll() is None
    assert f"request refused: {problem}" in log.read_text()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_logit_bias_outside_the_vocabulary_is_refused_greedy_or_not(temperature: float):
    from pipeline.runtime.servers.mlx_lm.generation_thread import sampling_problem

    provider = SimpleNamespace(model=SimpleNamespace(args=SimpleNamespace(vocab_size=1024)))
    sampling = SimpleNamespace(
        temperature=temperature, top_k=0, xtc_probability=0.0, xtc_threshold=0.1
    )
    for bias, problem in (({5: 1.0, 1023: -2.0}, None), ({1024: 1.0}, 1024), ({-1: 1.0}, -1)):
        args = SimpleNamespace(sampling=sampling, logits=SimpleNamespace(logit_bias=bias))
        expected = problem and (
            f"logit_bias token ids must be in [0, 1024) (the vocabulary), got {problem}"
        )
        assert sampling_problem(args, provider) == expected


def test_serve_hard_exits_when_the_main_thread_does_not_stop(tmp_path: Path):
    # A SIGINT handler that swallows the interrupt: the grace period's timer ends the process.
    script = (
        "import signal, time\n"
        "from pipeline.runtime.servers.mlx_lm.generation_thread import GenerationDeath\n"
        "signal.signal(signal.SIGINT, lambda *_: None)\n"
        "GenerationDeath(grace_s=0.5).report('RuntimeError: test')\n"
        "time.sleep(30)\n"
    )
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1 and 0.5 <= time.monotonic() - start < 20
    assert done.stderr == "generation thread died (RuntimeError: test); serve exits with status 1\n"


# --- serve exits when it says it failed (issue 28.2) -----------------------------------------------


def _serve_on_taken_port(tiny_model: Path, bundles: Path, tmp_path: Path, entry: Path, server: str):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        args = [sys.executable, str(entry), "serve", "--model", str(tiny_model), "--bundles",
                str(bundles), "--port", str(port), "--host", "127.0.0.1"]  # fmt: skip
        if server != "mlx-lm":
            args += ["--server", server]
        done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    return done, port


def test_a_taken_port_fails_before_anything_is_loaded(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path
):
    started = time.monotonic()
    done, port = _serve_on_taken_port(
        tiny_model, shop_bundle.parents[2], tmp_path, ROOT / "build.py", "mlx-lm"
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"error: cannot listen on 127.0.0.1:{port} (Address already in use); stop the process "
        "using it or pass another --port (nothing was loaded or mounted)"
    )
    assert "bundle(s) mounted" not in done.stderr and time.monotonic() - started < 60


def test_a_bind_failure_after_the_server_started_its_threads_still_exits_1(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path
):
    """The port taken between serve's check and mlx_lm.server's bind (the check skipped here):
    mlx_lm.server's generation thread is already running; serve must still end, with status 1."""
    entry = tmp_path / "no_port_check.py"
    entry.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import pipeline.runtime.servers as servers\n"
        "servers.check_port = lambda *a: None\n"
        "from pipeline.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    done, _ = _serve_on_taken_port(tiny_model, shop_bundle.parents[2], tmp_path, entry, "mlx-lm")
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1].startswith("error: ")
    assert "Address already in use" in done.stderr.splitlines()[-1]


# --- startup tells the truth (issue 28.4) -----------------------------------------------------------


def unusable_reason(bundle, rest: list[str]) -> str | None:
    """Why mlx_lm.server run with `rest` would not use `bundle` (its hook's declared rule)."""
    from pipeline.runtime.servers.mlx_lm import Hook
    from pipeline.runtime.servers.options import ServeOptions

    options = ServeOptions("mlx-lm", Path("model"), Path("bundles"), tuple(rest), (), True)
    return Hook().unusable(bundle, options)


@pytest.mark.parametrize(
    "option", [("--adapter-path", "adapters"), ("--draft-model", "draft")], ids=lambda o: o[0]
)
def test_a_bundle_the_options_would_never_use_is_not_counted_and_strict_refuses(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path, option
):
    from pipeline.runtime import PromptCacheManager, mount
    from pipeline.runtime.servers.mounted import BUNDLE_KEY
    from pipeline.runtime.servers.startup import drop_unusable

    manager = PromptCacheManager()
    result = mount(tiny_model, shop_bundle, manager=manager, model_key=BUNDLE_KEY)
    drop_unusable(
        result, manager, lambda b: unusable_reason(b, [option[0], str(tmp_path / option[1])])
    )
    assert not result.bundles and [p for p, _ in result.unused] == [shop_bundle]
    assert option[0] in result.unused[0][1] and manager.stats()["pinned"] == 0
    done = subprocess.run(
        [sys.executable, str(ROOT / "build.py"), "serve", "--model", str(tiny_model),
         "--bundles", str(shop_bundle.parents[2]), "--port", str(free_port()), "--strict",
         option[0], str(tmp_path / option[1])],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    last = done.stderr.splitlines()[-1]
    assert last.startswith(f"error: --strict: bundle {shop_bundle} would not be used: {option[0]}")
    assert "0 bundle(s) mounted, 0 refused, 1 not usable with the server's options" in done.stderr


def test_kv_bits_other_than_the_bundles_is_not_used_and_the_log_says_each_precision(
    shop_bundle: Path, tiny_model: Path
):
    from pipeline.runtime import mount

    (b,) = mount(tiny_model, shop_bundle).bundles
    assert b.precision == f"full precision ({b.manifest.cache.dtype})"
    assert unusable_reason(b, ["--kv-bits", "4"]) is None  # mlx_lm quantizes it as asked
    eight = dataclasses.replace(
        b,
        manifest=b.manifest.model_copy(
            update={"cache": b.manifest.cache.model_copy(update={"kv_bits": 8})}
        ),
    )
    assert eight.precision == "8-bit KV"
    assert unusable_reason(eight, ["--kv-bits", "8"]) is None
    assert unusable_reason(eight, []) is None
    assert unusable_reason(eight, ["--kv-bits", "4"]).startswith(
        "--kv-bits 4 asks for 4-bit KV but the bundle holds 8-bit KV"
    )


@pytest.mark.parametrize(
    "server, rest, meant",
    [
        ("mlx-lm", ["--kv-bit", "4"], "--kv-bits"),
        ("mlx-lm", ["--adapter-pat=adapters"], "--adapter-path"),
        ("vllm-mlx", ["--continuous-batch"], "--continuous-batching"),
        ("vllm-mlx", ["--continuous-batching", "--use-paged"], "--use-paged-cache"),
        ("vllm-mlx", ["--max-kv", "512"], "--max-kv-size"),
        ("rapid-mlx", ["--po", "9000"], "--port"),
    ],
)
def test_an_abbreviation_of_an_option_serve_reads_is_one_line_before_anything_loads(
    server: str, rest: list[str], meant: str
):
    """argparse-based servers take any unambiguous prefix of an option: `--kv-bit 4` is
    mlx_lm.server's --kv-bits 4, while serve, reading the options spelled out, checked the
    bundles against none (outside review: an 8-bit bundle mounted and served under 4-bit)."""
    from pipeline.runtime.servers import hook_for
    from pipeline.runtime.servers.options import ServeOptions, refuse_options

    hook = hook_for(server)
    options = ServeOptions(server, Path("model"), Path("bundles"), tuple(rest), (), True)
    flag = next(a.split("=")[0] for a in rest if meant.startswith(a.split("=")[0]) and a != meant)
    with pytest.raises(PipelineError) as caught:
        refuse_options(rest, server, hook.refused(options))
    assert str(caught.value) == (
        f"serve --server {server}: {flag} abbreviates {meant}, which serve reads "
        "to check the bundles against the server's options; spell it out"
    )


def test_vllm_mlx_batched_with_a_kv_bound_counts_no_bundle_as_mounted():
    """With --continuous-batching --max-kv-size, vllm-mlx's scheduler discards a restored
    KVCache: the bundle is not usable (before: counted as mounted, `cached_tokens` 361 reported,
    every request prefilled in full; outside review)."""
    from pipeline.runtime.servers.options import ServeOptions
    from pipeline.runtime.servers.vllm_mlx import Hook

    rest = ("--continuous-batching", "--max-kv-size", "512")
    options = ServeOptions("vllm-mlx", Path("model"), Path("bundles"), rest, (), True)
    assert Hook().unusable(None, options).startswith("--max-kv-size: with --continuous-batching")
    options = ServeOptions("vllm-mlx", Path("model"), Path("bundles"), rest[:1], (), True)
    assert Hook().unusable(None, options) is None


def test_options_spelled_out_and_the_servers_own_options_pass():
    from pipeline.runtime.servers.options import refuse_options

    for rest in (
        ["--kv-bits", "4", "--temp", "0.0", "--model", "m"],
        ["--specprefill", "--chat-template", "t", "--chat-template-args", "{}"],
        ["--", "--kv-bit"],  # past `--`: an argument, not an option
    ):
        refuse_options(rest, "mlx-lm", {})


def test_every_option_serve_reads_is_checked_for_abbreviations():
    """Each option name the runtime reads from the server's options (`passed`, `passed_option`,
    `in options.rest`, the vllm-mlx cache-off table) is in READ_OPTIONS (the start-up's own and
    every hook's `reads`, from the registry) or refused by its hook."""
    from pipeline.runtime.servers.options import NOT_ABBREVIATIONS, read_options
    from pipeline.runtime.servers.vllm_mlx.simple_engine import CACHE_OFF

    READ_OPTIONS = read_options()  # noqa: N806 - the table it was

    read = set(CACHE_OFF)
    for path in (ROOT / "pipeline" / "runtime").rglob("*.py"):
        text = path.read_text()
        read |= set(re.findall(r'passed(?:_option)?\([^)]*?"(--[a-z0-9-]+)"', text))
        read |= set(re.findall(r'"(--[a-z0-9-]+)" in (?:options\.)?rest', text))
        read |= set(re.findall(r'\("(--[a-z0-9-]+)", "(?:an adapter|a draft model)"\)', text))
    assert read and read <= set(READ_OPTIONS), read - set(READ_OPTIONS)
    assert not any(a.startswith(b) for a in NOT_ABBREVIATIONS for b in READ_OPTIONS)


# --- an exact hit never reaches the engine with nothing to process (issue 28.3) ---------------------


def complete(port: int, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0.0}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())["choices"][0]["text"]


def shorter_by(tokenizer, text: str, n: int) -> str:
    """`text` less its last n tokens, as text that encodes to exactly those tokens."""
    ids = tokenizer.encode(text)
    cut = tokenizer.decode(ids[:-n])
    assert tokenizer.encode(cut) == ids[:-n], "pick a text whose prefix re-encodes stably"
    return cut


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma3_text", "lfm2"])
def test_a_then_a_minus_a_token_and_neighbours_answer_like_cold(
    arch: str, tiny_model: Path, tmp_path: Path
):
    """mlx-lm's own cache keeps a rotating or recurrent entry it cannot trim; a request that is an
    exact hit on it had nothing left to process, and serve died ('Sequence 1 has an empty
    prompt'). Every sequence must answer as a cold model does, the server alive after."""
    from concurrent.futures import ThreadPoolExecutor

    from mlx_lm import load
    from mlx_lm.generate import stream_generate

    from pipeline.testmodels.arch import generate_arch_model

    model_dir = generate_arch_model(tmp_path / "model", arch, tiny_model)
    model, tokenizer = load(str(model_dir))
    a = " ".join(["The quick brown fox jumps over the lazy dog"] * 6)  # past gemma3's 32 window
    prompts = {"A": a, "A-1": shorter_by(tokenizer, a, 1), "A-2": shorter_by(tokenizer, a, 2)}
    sequence = ["A", "A-1", "A", "A", "A-2", "A-1"]
    empty = tmp_path / "no-bundles"
    empty.mkdir()
    with server_process(model_dir, empty, tmp_path / "serve.log") as (proc, port):
        answers = [(name, complete(port, prompts[name])) for name in sequence]
        with ThreadPoolExecutor(3) as pool:
            names = ["A", "A-1", "A-2"]
            answers += zip(
                names, pool.map(lambda n: complete(port, prompts[n]), names), strict=True
            )
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
    for name, text in answers:
        cold = "".join(
            r.text
            for r in stream_generate(
                model, tokenizer, tokenizer.encode(prompts[name]), max_tokens=6
            )
        )
        assert text == cold, (arch, name)


# --- a new version goes live without a restart (issue 25.3) -------------------------------------------


def wait_for(log: Path, text: str, count: int = 1, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while log.read_text().count(text) < count:
        assert time.monotonic() < deadline, f"{text!r} not logged: {log.read_text()[-3000:]}"
        time.sleep(0.2)


def wait_sighup_ignored(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Until the process ignores SIGHUP (its SigIgn mask in /proc holds signal 1)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        status = Path(f"/proc/{proc.pid}/status").read_text()
        ignored = int(
            next(x for x in status.splitlines() if x.startswith("SigIgn:")).split()[1], 16
        )
        if ignored & (1 << (signal.SIGHUP - 1)):
            return
        time.sleep(0.005)
    raise AssertionError(f"serve did not ignore SIGHUP within {timeout} s (exit {proc.poll()})")


@pytest.mark.slow
def test_a_sighup_never_kills_serve_starting_or_stopping(tiny_model: Path, tmp_path: Path):
    """A deploy's reload (`systemctl reload`: SIGHUP) while serve starts, or while it saves its
    snapshots at a stop, killed it (SIGHUP's default action: exit -1, no line). During start-up
    it is noted and read once the remount is in place; after the stop it is ignored."""
    from test_incremental import define, run_build

    root = tmp_path / "project"
    define(root, tiny_model)
    run_build(root)
    port, log = free_port(), tmp_path / "serve.log"
    args = [sys.executable, str(ROOT / "build.py"), "serve", "--model", str(tiny_model),
            "--bundles", str(root / "bundles"), "--port", str(port),
            "--snapshots", str(tmp_path / "snaps")]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        try:
            # serve's first step ignores it; before that the interpreter starts (imports: ~0.2 s,
            # more on a loaded machine), where a SIGHUP ends any process: not what is tested
            wait_sighup_ignored(proc)
            for _ in range(5):  # from the first steps on (imports, mount, warm-up)
                time.sleep(0.15)
                proc.send_signal(signal.SIGHUP)
            wait_ready(port, proc, log)
            wait_for(log, "remount: a SIGHUP came during start-up; re-reading the bundles")
            wait_for(log, "remount: 0 added, 0 replaced, 0 removed, 1 kept")
            chat(port, "Where is my order 12345?")
            proc.send_signal(signal.SIGTERM)  # a graceful stop: the snapshots are saved
            for _ in range(20):
                time.sleep(0.02)
                proc.send_signal(signal.SIGHUP)
            assert proc.wait(timeout=60) == 0, log.read_text()
        finally:
            proc.kill()
            proc.wait(timeout=30)
    assert "snapshots: saved" in log.read_text()


@pytest.mark.slow
def test_ctrl_c_ends_serve_with_its_status_not_an_abort(tiny_model: Path, tmp_path: Path):
    """After the server ran, its threads (MLX's among them) could abort the interpreter's
    teardown: Ctrl-C ended serve with SIGABRT ("terminate called without an active exception")
    in about half the runs here (plain mlx_lm.server too). serve ends the process itself once
    everything is written: 0 (mlx_lm.server stopped on the interrupt) or 130."""
    bundles = tmp_path / "bundles"
    bundles.mkdir()
    for run in range(4):
        log = tmp_path / f"serve{run}.log"
        with server_process(tiny_model, bundles, log, "--no-warm-up") as (proc, port):
            time.sleep(0.3 * run)
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=60)
        assert code in (0, 130), (run, code, log.read_text()[-400:])
        assert "terminate called" not in log.read_text()


@pytest.mark.slow
def test_sighup_remounts_new_refused_and_removed_versions_while_serving(
    tiny_model: Path, tmp_path: Path
):
    from concurrent.futures import ThreadPoolExecutor

    from test_incremental import MORE, define, run_build
    from test_soak import tree_rss as rss

    root = tmp_path / "project"
    define(root, tiny_model)
    v1 = run_build(root)
    log = tmp_path / "serve.log"
    with server_process(tiny_model, root / "bundles", log) as (proc, port):
        chat(port, "Where is my order 12345?")
        assert f"bundle shop@1 covers {v1.manifest.tokens.count} of" in log.read_text()
        define(root, tiny_model, version=2, system=SYSTEM + MORE)
        v2 = run_build(root)
        with ThreadPoolExecutor(4) as pool:  # a deploy's SIGHUP while 4 requests run
            running = [pool.submit(chat, port, f"Order {i}?") for i in range(4)]
            proc.send_signal(signal.SIGHUP)
            assert all("choices" in r.result() for r in running)
        wait_for(log, "remount: 0 added, 1 replaced")
        assert "remount: replaced shop@1 by shop@2" in log.read_text()
        chat(port, "Where is my order 12345?", SYSTEM + MORE)
        assert f"bundle shop@2 covers {v2.manifest.tokens.count} of" in log.read_text()

        define(root, tiny_model, version=3, system=SYSTEM + MORE + " Be kind.")
        v3 = run_build(root)
        cache = v3.bundle / "cache.safetensors"
        data = bytearray(cache.read_bytes())
        data[-5] ^= 0x01
        cache.write_bytes(bytes(data))  # a corrupt new version: the mounted one stays
        proc.send_signal(signal.SIGHUP)
        wait_for(log, "1 refused")
        assert f"remount: refused {v3.bundle}: " in log.read_text()
        before = log.read_text().count("bundle shop@2 covers")
        chat(port, "Anything else?", SYSTEM + MORE)
        assert log.read_text().count("bundle shop@2 covers") == before + 1

        start = rss(proc.pid)
        for i in range(20):  # remounts that change nothing leave memory where it was
            proc.send_signal(signal.SIGHUP)
            wait_for(log, " kept, ", count=3 + i, timeout=60)  # one summary per remount
        assert rss(proc.pid) <= start * 1.10

        shutil.rmtree(root / "bundles" / "shop")  # removed: no longer used
        proc.send_signal(signal.SIGHUP)
        wait_for(log, "remount: removed shop@2 (its bundle is gone)")
        chat(port, "Last one?", SYSTEM + MORE)
        assert log.read_text().rstrip().count("no bundle covers") >= 1
        assert proc.poll() is None


def admin(port: int, method: str, path: str, token: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        method=method,
        headers=headers,
        data=b"" if method == "POST" else None,
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.slow
def test_the_admin_endpoint_remounts_and_answers_with_a_json_report(
    tiny_model: Path, tmp_path: Path
):
    from test_incremental import MORE, define, run_build

    root = tmp_path / "project"
    define(root, tiny_model)
    run_build(root)
    token = "s3cret-token-0123456789"
    (tmp_path / "token").write_text(token + "\n")
    os.chmod(tmp_path / "token", 0o600)  # serve refuses a token file others can read
    admin_port = free_port()
    extra = ("--admin-port", str(admin_port), "--admin-token-file", str(tmp_path / "token"))
    log = tmp_path / "serve.log"
    with server_process(tiny_model, root / "bundles", log, *extra) as (proc, port):
        assert admin(admin_port, "POST", "/v1/bundles/remount")[0] == 401
        assert admin(admin_port, "POST", "/v1/bundles/remount", "wrong-token-0123456")[0] == 401
        status, listing = admin(admin_port, "GET", "/v1/bundles", token)
        assert status == 200 and [m["name"] for m in listing["mounted"]] == ["shop@1"]

        define(root, tiny_model, version=2, system=SYSTEM + MORE)
        v2 = run_build(root)
        status, report = admin(admin_port, "POST", "/v1/bundles/remount", token)
        assert status == 200 and report["schema"] == "remount/2"
        assert report["replaced"] == [{"old": "shop@1", "new": "shop@2"}]
        assert [m["name"] for m in report["mounted"]] == ["shop@2"]
        chat(port, "Where is my order 12345?", SYSTEM + MORE)
        assert f"bundle shop@2 covers {v2.manifest.tokens.count} of" in log.read_text()

        define(root, tiny_model, version=3, system=SYSTEM + MORE + " Be kind.")
        v3 = run_build(root)
        (v3.bundle / "cache.safetensors").write_bytes(b"truncated")
        status, report = admin(admin_port, "POST", "/v1/bundles/remount", token)
        assert status == 200 and report["refused"][0]["path"] == str(v3.bundle)
        assert [m["name"] for m in report["mounted"]] == ["shop@2"]  # the old version stays
        assert report["kept"] == ["shop@2"]
        assert report["serving"] == [
            {"name": "shop@2", "why": "its new version was refused or is not usable"}
        ]
        from pipeline.runtime.admin import RemountReport

        RemountReport.model_validate(report)  # what `schema remount` documents
        assert "WARNING" in log.read_text().split("remount: refused")[0].splitlines()[-1]
        assert proc.poll() is None


def test_an_admin_port_that_is_taken_is_one_error_line(tiny_model: Path, tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = [sys.executable, str(ROOT / "build.py"), "serve", "--model", str(tiny_model)]
        args += ["--bundles", str(tmp_path), "--port", str(free_port()), "--admin-port", str(port)]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and lines[-1].startswith(
        f"error: --admin-port {port}: cannot listen"
    )


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--admin-port", "99999"], "error: --admin-port '99999' is not a port number"),
        (["--admin-port", "0"], "error: --admin-port '0' is not a port number"),
        (["--port", "99999"], "error: --port '99999' is not a port number"),
        (["--port", "0"], "error: --port '0' is not a port number"),
        (
            ["--admin-token-file", "/nonexistent/token"],
            "error: --admin-token-file needs --admin-port",
        ),
        (
            ["--admin-port", "PORT", "--admin-token-file", "/nonexistent/token"],
            "error: --admin-token-file /nonexistent/token: cannot read a token",
        ),
    ],
)
def test_options_that_cannot_be_honoured_are_one_error_line_before_mounting(
    tiny_model: Path, tmp_path: Path, options: list[str], expected: str
):
    options = [str(free_port()) if o == "PORT" else o for o in options]
    args = [sys.executable, str(ROOT / "build.py"), "serve", "--model", str(tiny_model)]
    args += ["--bundles", str(tmp_path), *options]
    if "--port" not in options:
        args += ["--port", str(free_port())]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    usage = "cannot read" not in expected  # a token file it cannot read is bad input, not usage
    assert proc.returncode == (2 if usage else 1) and lines[-1].startswith(expected), proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr  # nothing mounted, nothing logged


def test_mlx_lm_server_opens_its_port_only_after_the_warm_up(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path
):
    """The first /health answer comes after the warm-up line (mlx_lm.server opened its port at
    once while its generation thread loaded the model: a load balancer sent traffic first)."""
    log = tmp_path / "serve.log"
    with server_process(tiny_model, shop_bundle.parents[2], log) as (proc, port):
        text = log.read_text()
    warmed = text.index("warmed up from shop@1")
    assert warmed < text.index("Starting httpd") < text.index("GET /health")
    assert f"ready: POST http://127.0.0.1:{port}/v1/chat/completions" in text
    assert "try a request opening with shop@1's prompt" in text  # the bundle's, not "Hello"
    assert f"| curl -s http://127.0.0.1:{port}/v1/chat/completions" in text


@pytest.mark.slow
def test_a_remount_that_replaces_a_4_bit_bundle_does_not_bring_lossy_reuse_back(
    tiny_model: Path, tmp_path: Path
):
    """mlx_lm.server's LRU keeps the entry continued from the 4-bit bundle; after a remount
    replaces that bundle by a full-precision version, a request that shares only the template's
    opening with it must not be served from that entry (the floor was computed from what was
    pinned now: the remount laundered it): cached 0, the answer of a cold server."""
    from test_incremental import MORE, define, run_build

    root = tmp_path / "project"
    define(root, tiny_model, kv_bits=4, kv_group_size=32)
    run_build(root)
    log = tmp_path / "serve.log"
    unrelated = {"question": "Say hi.", "system": None, "tools": []}
    with server_process(tiny_model, root / "bundles", log) as (proc, port):
        assert cached(chat(port, "Where is my order 12345?")) > 0  # from the 4-bit bundle
        define(root, tiny_model, version=2, system=SYSTEM + MORE)  # full precision now
        run_build(root, incremental=False)
        proc.send_signal(signal.SIGHUP)
        wait_for(log, "remount: 0 added, 1 replaced")
        warm = chat(port, **unrelated)
    empty = tmp_path / "empty"
    empty.mkdir()
    with server_process(tiny_model, empty, tmp_path / "cold.log") as (_, port):
        cold = chat(port, **unrelated)
    last = [ln for ln in log.read_text().splitlines() if "mlx_lm.server request:" in ln][-1]
    assert "server's own cache" not in last or "is used" not in last, last
    assert cached(warm) <= 1 and ("bundle shop@2 covers" in last or cached(warm) == 0), last
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]


def test_a_ctrl_c_is_said_as_it_comes_and_the_mount_names_its_imports(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path
):
    """SIGINT (Ctrl-C) stops serve with a line saying so (there was none: a stop that saves
    snapshots read as a hang); the mount summary says what of its time was one-time imports."""
    log = tmp_path / "serve.log"
    with server_process(tiny_model, shop_bundle.parents[2], log) as (proc, _port):
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    text = log.read_text()
    assert code in (0, 130) and "- INFO - SIGINT: stopping\n" in text, text[-2000:]
    tokens = json.loads((shop_bundle / "manifest.json").read_text())["tokens"]["count"]
    assert (
        f"a request is served from a bundle when it opens with that bundle's prompt: shop@1 "
        f"({tokens:,} tokens); 'prefix-bundles match --model {tiny_model} --prompt-file "
        "REQUEST.json' says how many tokens"
    ) in text
    assert " ms of it the one-time imports a load needs)" in text
