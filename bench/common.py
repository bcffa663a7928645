"""Shared helpers of the benchmark cases: paths, models, prompt text, definitions, subprocesses, stats."""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
WORKER = BENCH / "worker.py"
# Qwen3-0.6B shapes; `--quick` (bench/run.py sets the variable before the cases import this) runs
# the 4-layer "small" model of the same family, so that every case runs in minutes.
MODEL_SIZE = os.environ.get("PREFIX_BUNDLES_BENCH_SIZE", "bench")
MODEL_BF16 = REPO / "models" / {"bench": "bench-qwen3-0.6b"}.get(MODEL_SIZE, f"bench-{MODEL_SIZE}")
MODEL_F32 = MODEL_BF16.with_name(MODEL_BF16.name + "-f32")
QUESTION = (
    "Using the notes above, which three items matter most today, and why? Answer in one line."
)
QUESTION2 = "Which of the notes above is the oldest, and who wrote it? Answer in one line."
# the notes prompt of the restart and architecture cases
SYSTEM = "You are the assistant of a field team. Answer from these notes only.\nNotes:\n"
TEMPLATE_TOKENS = 16  # tokens the template and SYSTEM add around the notes (measured: ~14)
HUGE_PAGES = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}  # what `serve --huge-pages on` sets
RESULT_TAG = "BENCH-RESULT "


@dataclass
class Context:
    """What every case gets: mode, folders, and a log of what ran."""

    quick: bool
    work: Path
    log: list[str] = field(default_factory=list)

    def note(self, line: str) -> None:
        """Print a progress line (to stderr) and keep it for the results."""
        stamp = time.strftime("%H:%M:%S")
        print(f"[{stamp}] {line}", file=sys.stderr, flush=True)
        self.log.append(line)


def ensure_models() -> dict[str, Path]:
    """Generate the bench models (bf16 as shipped, float32 variant) when missing."""
    from pipeline.testmodels.model import generate_model

    return {
        "bfloat16": generate_model(MODEL_BF16, MODEL_SIZE),
        "float32": generate_model(MODEL_F32, MODEL_SIZE, dtype="float32"),
    }


def dir_bytes(path: Path, pattern: str = "*.safetensors") -> int:
    """Bytes of the files matching pattern in a folder."""
    return sum(p.stat().st_size for p in Path(path).glob(pattern) if p.is_file())


# --- Prompt text of a given token length -----------------------------------------------------


def prose(words: int, seed: int = 0) -> str:
    """Deterministic English-like notes (the test tokenizer was trained on these words)."""
    from pipeline.testmodels.tokenizer import WORDS

    r = random.Random(seed)
    lines, count = [], 0
    while count < words:
        n = r.randint(6, 16)
        sentence = " ".join(r.choice(WORDS) for _ in range(n))
        lines.append(f"- {sentence[0].upper()}{sentence[1:]}.")
        count += n
    return "\n".join(lines)


def text_with_tokens(model_dir: Path, tokens: int, seed: int = 0) -> str:
    """Prose whose tokenization is close to (not above) `tokens` tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    count = lambda t: len(tok.encode(t, add_special_tokens=False).ids)  # noqa: E731
    low, high = 1, tokens * 2
    while low < high:  # largest word count whose text stays within the budget
        mid = (low + high + 1) // 2
        low, high = (mid, high) if count(prose(mid, seed)) <= tokens else (low, mid - 1)
    return prose(low, seed)


def write_definition(
    project: Path, name: str, model_dir: Path, messages: list[dict], **cache: Any
) -> Path:
    """prefixes/<name>.toml under project, with inline messages and the model's own template."""
    from pipeline.format.fingerprint import model_chat_template, sha256_text

    prefixes = project / "prefixes"
    prefixes.mkdir(parents=True, exist_ok=True)
    sha = sha256_text(model_chat_template(model_dir))
    lines = [
        f'name = "{name}"',
        "version = 1",
        "",
        "[template]",
        'source = "model"',
        f'sha256 = "{sha}"',
    ]
    lines += ["", "[prefix]"]
    for m in messages:
        lines += [
            "",
            "[[prefix.messages]]",
            f'role = "{m["role"]}"',
            f"content = {json.dumps(m['content'])}",
        ]
    lines += ["", "[[models]]", f'path = "{model_dir}"', "", "[cache]"]
    lines += [f"{k} = {v}" for k, v in cache.items() if v is not None]
    path = prefixes / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


# --- Subprocesses -------------------------------------------------------------------------


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a measured subprocess: no preloads of ours, repo on the path."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PREFIX_BUNDLES_OPENBLAS")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def run_worker(
    task: str, args: dict[str, Any], timeout: float = 1800, **env: str
) -> dict[str, Any]:
    """Run `bench/worker.py task` in a fresh process; its JSON result plus spawn/wall seconds."""
    spawn = time.time()
    proc = subprocess.run(
        [sys.executable, str(WORKER), task, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean_env(**env),
        cwd=REPO,
    )
    wall = time.time() - spawn
    result = parse_result(proc.stdout)
    if proc.returncode != 0 or result is None:
        raise RuntimeError(f"worker {task} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    result["spawn_time"], result["process_seconds"] = spawn, wall
    return result


def parse_result(stdout: str) -> dict[str, Any] | None:
    """The last BENCH-RESULT line of a worker's output."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    return None


def timed_command(
    cmd: list[str], stdin: str | None = None, timeout: float = 1800, **env: str
) -> tuple[float, str]:
    """(wall seconds, combined output) of a command in a fresh process; raise on failure."""
    start = time.perf_counter()
    proc = subprocess.run(
        cmd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean_env(**env),
        cwd=REPO,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd[:4])} failed (exit {proc.returncode}): {proc.stderr[-2000:]}"
        )
    return wall, proc.stdout + proc.stderr


# --- Statistics -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Stat:
    """Median, min, max and count of repeated measurements."""

    median: float
    low: float
    high: float
    n: int

    def cell(self, fmt: str = "{:.3g}") -> str:
        """'median (min–max)' for a table; just the value when n == 1."""
        if self.n == 1:
            return fmt.format(self.median)
        return f"{fmt.format(self.median)} ({fmt.format(self.low)}–{fmt.format(self.high)})"

    def as_dict(self) -> dict[str, float]:
        return {"median": self.median, "min": self.low, "max": self.high, "n": self.n}


def stat(values: list[float]) -> Stat:
    """Summary of repeated measurements."""
    return Stat(statistics.median(values), min(values), max(values), len(values))


def ratio(a: float, b: float) -> float:
    """a / b, guarded against zero."""
    return a / b if b else float("inf")


def standalone(name: str, run: Any, section: Any) -> None:
    """A case run as its own script (`python bench/case_NAME.py [--quick] [--render]`): run it
    into bench/out/NAME/NAME.json (`--render`: only print the last run's section), then print
    its section of RESULTS.md."""
    from pipeline.blas import ensure_fast_blas

    ensure_fast_blas(sys.argv[1:])
    work = REPO / "bench" / "out" / name
    work.mkdir(parents=True, exist_ok=True)
    if "--render" not in sys.argv:
        result = run(Context("--quick" in sys.argv, work))
        (work / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(section(json.loads((work / f"{name}.json").read_text()))))


def post_json(port: int, route: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(seconds, answer) of one JSON POST to a server on loopback."""
    import urllib.request

    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{route}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=1800) as resp:
        answer = json.loads(resp.read())
    return time.perf_counter() - t, answer


def target_row(target: str, measured: str, met: bool) -> dict[str, Any]:
    """One row of RESULTS.md's targets table."""
    return {"target": target, "measured": measured, "met": met}


def free_port() -> int:
    """A TCP port free on loopback now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc: Any, timeout: float = 300) -> None:
    """Until the server's /health answers; RuntimeError if it exits or never answers."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("server not ready")


def each(workers: int, jobs: dict[str, Any]) -> dict[str, tuple[Any, Exception | None]]:
    """{name: (result, None) or (None, the exception)} of each job, `workers` at a time (1: one
    after the other, in order)."""
    from concurrent.futures import ThreadPoolExecutor

    def caught(job: Any) -> tuple[Any, Exception | None]:
        try:
            return job(), None
        except Exception as exc:
            return None, exc

    with ThreadPoolExecutor(workers) as pool:
        futures = {name: pool.submit(caught, job) for name, job in jobs.items()}
    return {name: future.result() for name, future in futures.items()}
