"""Case: fleet distribution through a real OCI registry (Debian's docker-registry on loopback,
behind TLS as fleets run it: a CA made here signs its certificate for 127.0.0.1; ours verifies
with --ca-bundle, curl with --cacert).

A first version of ~1 GB (float32 bench model, ~4k tokens) pushed and pulled by
`pipeline.distribute` (token-range blocks, every block hashed as it moves and, on pull, checked
against the block digests the signed manifest pins (format 5), the one validator, an atomic
publish), side by side with `curl` uploading the cache
file as one blob (monolithic upload: POST, then PUT with its digest) and downloading it, against
the same registry, in one run. Each repetition starts a fresh registry; ours and curl alternate
which goes first. Ours runs in a fresh process (a worker) and reports its seconds per phase;
curl's figure is its wall time, ours the worker's (interpreter start and imports included).
Then, at the same scale: what a version appending 5 % and a sibling sharing 90 % of the tokens
(both built from the first) move each way, and the registry's storage growth against the bytes
the client reported moving.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # standalone: python bench/case_oci.py [--quick]
    sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
    if "--quick" in sys.argv[1:]:
        os.environ.setdefault("PREFIX_BUNDLES_BENCH_SIZE", "small")

from common import (  # noqa: E402
    MODEL_F32,
    RESULT_TAG,
    Context,
    clean_env,
    ratio,
    stat,
    write_definition,
)

from pipeline.format.manifest import FORMAT_VERSION  # noqa: E402

REGISTRY = "/usr/bin/docker-registry"
GOAL = 1.5  # ours / curl, push and pull (issue 40)
MOVE_GOALS = {"append": 0.10, "sibling": 0.15}  # moved / bundle bytes, each way
GROWTH_TOLERANCE = 0.10


def settings(quick: bool) -> dict[str, Any]:
    return {"tokens": 1024, "reps": 1} if quick else {"tokens": 4096, "reps": 3}


# --- the registry -------------------------------------------------------------------------------


class Registry:
    """docker-registry on a free loopback port, storing under folder; stopped by its PID."""

    def __init__(self, folder: Path) -> None:
        import socket
        import ssl

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from registry_env import make_tls  # the tests' CA and certificate for 127.0.0.1

        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.host, self.storage = f"127.0.0.1:{port}", folder / "storage"
        self.ca, cert, key = make_tls(folder / "tls")
        config = folder / "config.yml"
        config.write_text(
            "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.storage}\n"
            f"http:\n  addr: {self.host}\n  tls:\n    certificate: {cert}\n    key: {key}\n"
        )
        context = ssl.create_default_context(cafile=str(self.ca))
        log = open(folder / "registry.log", "wb")  # noqa: SIM115 (closed in stop)
        self.log = log
        self.process = subprocess.Popen(
            [REGISTRY, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"https://{self.host}/v2/", timeout=1, context=context)
                break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"docker-registry did not start on {self.host}") from None
                time.sleep(0.05)

    def repo(self, name: str = "bench/bundles") -> str:
        return f"oci://{self.host}/{name}"

    def args(self) -> dict[str, str]:
        """What our worker needs to reach it: the repo and the CA that verifies it."""
        return {"repo": self.repo(), "ca": str(self.ca)}

    def stored_bytes(self) -> int:
        blobs = self.storage / "docker/registry/v2/blobs"
        return sum(p.stat().st_size for p in blobs.rglob("data")) if blobs.exists() else 0

    def cpu(self) -> float:
        """CPU seconds the registry process has used so far (Linux /proc; 0.0 elsewhere)."""
        try:
            stat = Path(f"/proc/{self.process.pid}/stat").read_text()
        except OSError:
            return 0.0
        fields = stat.rsplit(")", 1)[1].split()  # fields 14 and 15: utime, stime (all threads)
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        os.kill(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()


# --- the two clients ----------------------------------------------------------------------------


def worker(task: str, args: dict[str, Any]) -> dict[str, Any]:
    """One push or pull through pipeline.distribute, in this (fresh) process, with its phases."""
    import resource

    from pipeline.distribute.meter import Meter

    meter = Meter()
    start, cpu0 = time.perf_counter(), time.process_time()
    if task == "push":
        from pipeline.distribute.checked import check_bundle
        from pipeline.distribute.oci_push import push_oci
        from pipeline.distribute.prehash import Prehash

        prehash = Prehash([Path(args["bundle"])])  # as push does: block digests meanwhile
        try:
            with meter.phase("validate", cpu=True):  # push validates the bundle's integrity first
                checked = check_bundle(Path(args["bundle"]), trust_memo=True)  # as push does
            result = push_oci(
                [checked], args["repo"], meter=meter, prehash=prehash, ca_bundle=args["ca"]
            )
        finally:
            prehash.close()
        bundle_bytes = result.artifacts[0].total_bytes
    else:
        with meter.phase("imports", cpu=True):
            from pipeline.distribute.oci_pull import pull_oci

        result = pull_oci(
            args["repo"],
            Path(args["model"]),
            Path(args["bundles"]),
            [args["prefix"]],
            meter=meter,
            ca_bundle=args["ca"],
        )
        if result.refused or result.failed or not result.pulled:
            raise RuntimeError(f"pull published nothing: {result.refused or result.failed}")
        bundle_bytes = result.transfer.moved_bytes + result.transfer.reused_bytes
    t = result.transfer
    used = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "seconds": time.perf_counter() - start,
        "phases": meter.seconds,
        "phase_cpu": meter.cpu,
        "cpu_in_process": time.process_time() - cpu0,
        "cpu_whole": used.ru_utime + used.ru_stime,  # interpreter start and bench imports too
        "moved_bytes": t.moved_bytes,
        "reused_bytes": t.reused_bytes,
        "bundle_bytes": bundle_bytes,
    }


def children_cpu() -> float:
    """CPU seconds (user + system) of this process's waited-for children so far."""
    import resource

    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def run_ours(task: str, args: dict[str, Any]) -> dict[str, Any]:
    spawn = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "worker", task, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=1800,
        env=clean_env(),
    )
    wall = time.perf_counter() - spawn
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{task} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return {**json.loads(lines[-1][len(RESULT_TAG) :]), "process_seconds": wall}


def curl_push(reg: Registry, path: Path, digest: str) -> float:
    """POST an upload session, then PUT the whole file with its digest (one blob)."""
    base = f"https://{reg.host}/v2/bench/curl/blobs/uploads/"
    start = time.perf_counter()
    head = subprocess.run(
        [
            "curl",
            "-sS",
            "-f",
            "--cacert",
            str(reg.ca),
            "-X",
            "POST",
            "-D",
            "-",
            "-o",
            "/dev/null",
            base,
        ],  # fmt: skip
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    location = next(
        x.split(":", 1)[1].strip() for x in head.splitlines() if x.lower().startswith("location:")
    )
    if location.startswith("/"):
        location = f"https://{reg.host}{location}"
    sep = "&" if "?" in location else "?"
    subprocess.run(
        ["curl", "-sS", "-f", "--cacert", str(reg.ca), "-X", "PUT", "-H", "Expect:", "-H",
         "Content-Type: application/octet-stream", "-T", str(path), "-o", "/dev/null",
         f"{location}{sep}digest={digest}"],
        check=True,
    )  # fmt: skip
    return time.perf_counter() - start


def curl_pull(reg: Registry, digest: str, out: Path) -> float:
    start = time.perf_counter()
    url = f"https://{reg.host}/v2/bench/curl/blobs/{digest}"
    subprocess.run(["curl", "-sS", "-f", "--cacert", str(reg.ca), "-o", str(out), url], check=True)
    seconds = time.perf_counter() - start
    if out.stat().st_size == 0:
        raise RuntimeError("curl downloaded nothing")
    return seconds


# --- the case -----------------------------------------------------------------------------------


def build_bundles(ctx: Context, tokens: int) -> dict[str, Path]:
    """The first version (a full build), then the 5 % append and the 90 % sibling built from it."""
    from case_incremental import one_build, texts

    project = ctx.work / f"oci-{tokens}"
    for name, text in texts(tokens).items():  # the same texts as the incremental case
        write_definition(project, f"oci-{name}", MODEL_F32, [{"role": "system", "content": text}])
    bundles, out = project / "bundles", {}
    for name in ("base", "append", "sibling"):
        # built by an earlier run of this case from the same definitions: kept (builds take
        # minutes; what is measured here is moving them)
        found = [
            p
            for p in sorted(bundles.glob(f"oci-{name}/1/*/manifest.json"))
            if json.loads(p.read_text()).get("format_version") == FORMAT_VERSION
        ]  # a bundle of an older format is built again (pull proves format 5's blocks)
        if found:
            out[name] = found[0].parent
            continue
        ctx.note(f"oci: building oci-{name} ({tokens} tokens{', from the base' if out else ''})")
        r = one_build(project, f"oci-{name}", incremental=bool(out))  # into project/bundles
        out[name] = Path(r["bundle"])
    return out


def run(ctx: Context) -> dict[str, Any]:
    if not Path(REGISTRY).exists():
        raise RuntimeError(f"{REGISTRY} missing: apt-get install docker-registry")
    from pipeline.format.fingerprint import model_identity

    cfg = settings(ctx.quick)
    model_identity(MODEL_F32)  # weights hashed once, memoised (a server's steady state)
    bundles = build_bundles(ctx, cfg["tokens"])
    base = bundles["base"]
    manifest = json.loads((base / "manifest.json").read_text())
    digest = "sha256:" + manifest["cache"]["file_sha256"]
    file_bytes = (base / "cache.safetensors").stat().st_size
    reps = [one_rep(ctx, rep, base, digest) for rep in range(cfg["reps"])]
    moves = incremental_moves(ctx, bundles)
    return {
        "tokens": manifest["tokens"]["count"],
        "file_bytes": file_bytes,
        "reps": reps,
        "summary": summarize(reps),
        "moves": moves,
    }


def one_rep(ctx: Context, rep: int, base: Path, digest: str) -> dict[str, Any]:
    """A fresh registry; ours and curl side by side, in alternating order."""
    folder = ctx.work / "oci-registry"
    reg = Registry(folder)
    try:
        out: dict[str, Any] = {}
        order = ("ours", "curl") if rep % 2 == 0 else ("curl", "ours")
        for who in order:
            ctx.note(f"oci: rep {rep + 1}, {who}")
            if who == "curl":
                push = metered(reg, curl_push, reg, base / "cache.safetensors", digest)
                target = folder / "curl-download.safetensors"
                pull = metered(reg, curl_pull, reg, digest, target)
                target.unlink()
                for way, (seconds, cpu, registry_cpu) in (("push", push), ("pull", pull)):
                    out[f"curl_{way}"] = seconds
                    out[f"curl_{way}_cpu"] = {"client": cpu, "registry": registry_cpu}
                continue
            before = reg.stored_bytes()
            push = metered(reg, run_ours, "push", {"bundle": str(base), **reg.args()})
            out["storage_growth"] = reg.stored_bytes() - before
            pulled = folder / "pulled"
            args = {**reg.args(), "model": str(MODEL_F32), "bundles": str(pulled)}
            pull = metered(reg, run_ours, "pull", {**args, "prefix": "oci-base"})
            shutil.rmtree(pulled)
            for way, (result, cpu, registry_cpu) in (("push", push), ("pull", pull)):
                out[way] = {**result, "cpu": {"client": cpu, "registry": registry_cpu}}
        return out
    finally:
        reg.stop()
        shutil.rmtree(folder, ignore_errors=True)


def metered(reg: Registry, fn: Any, *args: Any) -> tuple[Any, float, float]:
    """fn(*args), the CPU seconds of the processes it ran and waited for, and the registry's."""
    c0, r0 = children_cpu(), reg.cpu()
    out = fn(*args)
    return out, children_cpu() - c0, reg.cpu() - r0


def incremental_moves(ctx: Context, bundles: dict[str, Path]) -> dict[str, Any]:
    """Base pushed and pulled; then the append and the sibling: what moves each way."""
    folder = ctx.work / "oci-registry"
    reg = Registry(folder)
    pulled = folder / "pulled"
    args = {**reg.args(), "model": str(MODEL_F32), "bundles": str(pulled)}
    try:
        run_ours("push", {"bundle": str(bundles["base"]), **reg.args()})
        run_ours("pull", {**args, "prefix": "oci-base"})
        out = {}
        for name in ("append", "sibling"):
            ctx.note(f"oci: {name} after the base")
            before = reg.stored_bytes()
            push = run_ours("push", {"bundle": str(bundles[name]), **reg.args()})
            growth = reg.stored_bytes() - before
            pull = run_ours("pull", {**args, "prefix": f"oci-{name}"})
            reused = json.loads((bundles[name] / "manifest.json").read_text())["parent"]
            out[name] = {
                "bundle_bytes": push["bundle_bytes"],
                "shared_tokens": reused["reused_tokens"] if reused else 0,
                "push_moved": push["moved_bytes"],
                "pull_moved": pull["moved_bytes"],
                "push_ratio": push["moved_bytes"] / push["bundle_bytes"],
                "pull_ratio": pull["moved_bytes"] / pull["bundle_bytes"],
                "push_s": push["process_seconds"],
                "pull_s": pull["process_seconds"],
                "storage_growth": growth,
            }
        return out
    finally:
        reg.stop()
        shutil.rmtree(folder, ignore_errors=True)


def cpu_summary(reps: list[dict[str, Any]], way: str) -> dict[str, Any]:
    """CPU seconds of each side (the client's processes, the registry) and what the two cost
    together spread over every core: the least wall time they could take side by side."""
    cores = os.cpu_count() or 1
    ours = [r[way]["cpu"] for r in reps]
    curl = [r[f"curl_{way}_cpu"] for r in reps]
    both = [o["client"] + o["registry"] for o in ours]
    return {
        "cores": cores,
        "ours_client": stat([o["client"] for o in ours]).as_dict(),
        "ours_registry": stat([o["registry"] for o in ours]).as_dict(),
        "ours_validate": stat([r[way].get("phase_cpu", {}).get("validate", 0.0) for r in reps]).as_dict(),
        "curl_client": stat([c["client"] for c in curl]).as_dict(),
        "curl_registry": stat([c["registry"] for c in curl]).as_dict(),
        "ours_floor_s": stat([b / cores for b in both]).as_dict(),
        "cpu_ratio": stat(
            [b / (c["client"] + c["registry"]) for b, c in zip(both, curl, strict=True)]
        ).as_dict(),
    }  # fmt: skip


def summarize(reps: list[dict[str, Any]]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    for way in ("push", "pull"):
        ours = stat([r[way]["process_seconds"] for r in reps])
        curl = stat([r[f"curl_{way}"] for r in reps])
        per_rep = [r[way]["process_seconds"] / r[f"curl_{way}"] for r in reps]
        phases = sorted({p for r in reps for p in r[way]["phases"]})
        s[way] = {
            "ours_s": ours.as_dict(),
            "in_process_s": stat([r[way]["seconds"] for r in reps]).as_dict(),
            "curl_s": curl.as_dict(),
            "ratio": ratio(ours.median, curl.median),
            "ratio_per_rep": stat(per_rep).as_dict(),
            "phases": {p: stat([r[way]["phases"].get(p, 0.0) for r in reps]).as_dict() for p in phases},
            "cpu": cpu_summary(reps, way),
        }  # fmt: skip
    growth = [r["storage_growth"] / r["push"]["moved_bytes"] - 1 for r in reps]
    s["storage_growth_error"] = max(growth, key=abs)
    return s


# --- the report ---------------------------------------------------------------------------------


def section(r: dict[str, Any]) -> list[str]:
    """The RESULTS.md section."""
    from report import cell, heading, table

    gb = r["file_bytes"] / 1e9
    lines = [
        *heading("Fleet distribution through an OCI registry (float32 model)", __doc__),
        f"A {r['tokens']}-token bundle, cache file {gb:.2f} GB. Seconds, median (min–max). Phases "
        "of ours (in its process; blobs move 4 at a time, so 'transfer', 'hash', 'write' and "
        "'read' are sums over the threads and exceed the wall time): 'transfer' is the time in "
        "HTTP calls, hashing and writing included (hash and write also shown alone); 'read' the "
        "rest blob cut out of the file (push reads each block by pread into one buffer it hashes "
        "and sends); 'model identity' the served model's fingerprints and cache classes (remembered "
        "by their exact inputs: no `import mlx_lm` once known); 'validate' the one validator "
        "(push: the bundle, trusting the hash memo; pull: against the model, then the atomic "
        "publish; a format-5 file, whose every block was checked against the manifest's pins "
        "as it landed, is not read again, a format-3 one is read once for its BLAKE3); pull's 'imports' its modules' import and 'fetch' the wall time of fetching "
        "the artifact (manifest, small files, every block downloaded, hashed and written in "
        "place: the transfer and rebuild as the clock sees them).",
        "",
    ]
    rows = []
    for way in ("push", "pull"):
        x = r["summary"][way]
        phases = ", ".join(f"{p} {cell(v)}" for p, v in x["phases"].items())
        rows.append(
            [way, cell(x["curl_s"]), cell(x["ours_s"]), cell(x["in_process_s"]),
             f"**{x['ratio']:.2f}×** (goal ≤ {GOAL}×)", cell(x["ratio_per_rep"], "{:.2f}"),
             phases, x["ours_s"]["n"]]
        )  # fmt: skip
    header = ["way", "curl s", "ours s (process)", "ours s (in process)", "ours / curl",
              "per repetition", "ours: phases (s)", "n"]  # fmt: skip
    lines += table(header, rows) + cpu_lines(r)
    err = r["summary"]["storage_growth_error"]
    lines += [f"Registry storage growth vs bytes the push reported moving: {err:+.2%}.", ""]
    moves = r["moves"]
    rows = [
        [name, f"{m['shared_tokens']:,}", f"{m['bundle_bytes'] / 1e6:,.1f}",
         f"{m['push_ratio']:.3f}", f"{m['pull_ratio']:.3f}", f"≤ {MOVE_GOALS[name]}",
         f"{m['storage_growth'] / m['push_moved'] - 1:+.2%}", f"{m['push_s']:.1f}",
         f"{m['pull_s']:.1f}"]
        for name, m in moves.items()
    ]  # fmt: skip
    header = ["after the base", "shared tokens", "MB", "push moved / bytes",
              "pull moved / bytes", "goal", "storage growth vs moved", "push s", "pull s"]  # fmt: skip
    return lines + table(header, rows)


def cpu_lines(r: dict[str, Any]) -> list[str]:
    """The CPU table: what each side costs, whatever else the machine runs meanwhile."""
    from report import cell, table

    if "cpu" not in r["summary"]["push"]:  # a run from before the case measured CPU
        return []
    rows = []
    for way in ("push", "pull"):
        c = r["summary"][way]["cpu"]
        rows.append(
            [way, cell(c["curl_client"]), cell(c["curl_registry"]), cell(c["ours_client"]),
             cell(c["ours_validate"]), cell(c["ours_registry"]), cell(c["cpu_ratio"], "{:.2f}"),
             cell(c["ours_floor_s"])]
        )  # fmt: skip
    cores = r["summary"]["push"]["cpu"]["cores"]
    header = ["way", "curl: client CPU s", "curl: registry CPU s", "ours: client CPU s",
              "ours: in its validate phase", "ours: registry CPU s", "CPU ours / curl",
              f"ours: CPU / {cores} cores (least wall s)"]  # fmt: skip
    return [
        "CPU seconds, median (min–max): the client's processes (curl's; ours, interpreter start "
        "included) and the registry's (from /proc); 'in its validate phase' is the whole process's "
        "CPU meanwhile (push hashes its blocks on other threads then). CPU depends little on what "
        "else runs; wall time does. Ours cannot take less wall time than its CPU and the "
        "registry's spread over every core.",
        "",
        *table(header, rows),
    ]


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for way in ("push", "pull"):
        x = r["summary"][way]
        out.append(
            {
                "target": f"OCI {way} of a {r['file_bytes'] / 1e9:.2f} GB first version ≤ {GOAL}× "
                f"curl moving the cache file as one blob",
                "measured": f"{x['ratio']:.2f}×",
                "met": x["ratio"] <= GOAL,
            }
        )
    for name, m in r["moves"].items():
        worst = max(m["push_ratio"], m["pull_ratio"])
        out.append(
            {
                "target": f"OCI {name} after the base moves ≤ {MOVE_GOALS[name]} of its bytes "
                "each way",
                "measured": f"push {m['push_ratio']:.3f}, pull {m['pull_ratio']:.3f}",
                "met": worst <= MOVE_GOALS[name],
            }
        )
    err = r["summary"]["storage_growth_error"]
    out.append(
        {
            "target": "registry storage grows by the bytes the client reports moving, ±10 %",
            "measured": f"{err:+.2%}",
            "met": abs(err) <= GROWTH_TOLERANCE,
        }
    )
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        print(RESULT_TAG + json.dumps(worker(sys.argv[2], json.loads(sys.argv[3]))), flush=True)
        sys.exit(0)
    from common import BENCH, ensure_models

    ctx = Context(quick="--quick" in sys.argv[1:], work=BENCH / "out")
    ctx.work.mkdir(parents=True, exist_ok=True)
    ensure_models()
    results = run(ctx)
    (ctx.work / "oci.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print("\n".join(section(results)))
    for t in targets(results):
        print(f"- {'met' if t['met'] else 'NOT MET'}: {t['target']}: {t['measured']}")
