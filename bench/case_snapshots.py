"""Case snapshots: `serve --snapshots DIR` across a restart. A server (mlx_lm.server, the default,
in this venv) holds N conversations of a few thousand tokens that no bundle covers; a graceful stop
(SIGTERM) saves them as N snapshots; then the time to the first answer of the next turn of one
conversation after a restart with the snapshots, vs the same server restarted without them (cold:
it prefills the whole history), vs the in-memory hit (the next question on the same history, in
the same process, right after). Also the stop (SIGTERM to exit, the save included), startup
(spawn to /health; the restore is the difference with and without), the saved set as `inspect
--json` reads it, and the cached tokens the usage reports; the same answer with and without
snapshots; and the next turn after `kill -9` of a --snapshots server once its spill while
serving holds the first turn (reuse of the spilled tokens, time against cold). Every figure is
structured (HTTP usage, the CLI's JSON, a manifest, the clock): no log is parsed.

The float32 bench model (`--quick`: the 4-layer one), OpenBLAS as serve loads it. Standalone:
`python bench/case_snapshots.py [--quick]` prints the markdown section.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent)]
if __name__ == "__main__" and "--quick" in sys.argv[1:]:  # as bench/run.py: the small model
    os.environ.setdefault("PREFIX_BUNDLES_BENCH_SIZE", "small")

from common import (  # noqa: E402
    MODEL_F32,
    QUESTION,
    QUESTION2,
    REPO,
    Context,
    clean_env,
    ensure_models,
    free_port,
    post_json,
    ratio,
    standalone,
    stat,
    text_with_tokens,
    wait_ready,
)

NEXT = "Which of the notes above is the newest, and who wrote it? Answer in one line."


def settings(quick: bool) -> dict[str, int]:
    """Conversations, their tokens, repetitions."""
    # full: two 4k-token conversations of the 0.6B model are 1.8 GiB of float32 KV, within the
    # default --snapshot-budget of 2 GiB; each cold prefill takes minutes on a 2-core VM
    if quick:
        return {"conversations": 2, "tokens": 1000, "n": 1}
    return {"conversations": 2, "tokens": 4000, "n": 3}


def messages(notes: str, answer: str | None, question: str) -> list[dict[str, str]]:
    """A conversation's first turn (no answer yet) or its next turn asking `question`."""
    turn = [{"role": "system", "content": notes}, {"role": "user", "content": QUESTION}]
    if answer is None:
        return turn
    return [*turn, {"role": "assistant", "content": answer}, {"role": "user", "content": question}]


def ask(port: int, msgs: list[dict[str, str]]) -> tuple[float, str, int, int]:
    """(seconds, answer, prompt tokens, cached tokens) of one chat request, 8 tokens greedy."""
    body = {"messages": msgs, "max_tokens": 8, "temperature": 0.0}
    seconds, answer = post_json(port, "/v1/chat/completions", body)
    usage = answer.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return seconds, answer["choices"][0]["message"]["content"], usage["prompt_tokens"], cached


class Server:
    """`build.py serve` (mlx_lm.server) with no bundle, optionally --snapshots DIR, logged."""

    def __init__(self, ctx: Context, model: Path, log: Path, snapshots: Path | None) -> None:
        empty = ctx.work / "snapshots-no-bundles"
        empty.mkdir(exist_ok=True)
        self.port, self.log = free_port(), log
        cmd = [sys.executable, str(REPO / "build.py"), "--bundles", str(empty), "serve"]
        cmd += ["--model", str(model), "--port", str(self.port)]
        cmd += [] if snapshots is None else ["--snapshots", str(snapshots)]
        # the host key under WORK: the bench never touches the user's ~/.config
        env = clean_env(XDG_CONFIG_HOME=str(ctx.work / "snapshots-config"))
        start = time.perf_counter()
        self.out = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT, env=env)
        wait_ready(self.port, self.proc)
        self.startup_s = time.perf_counter() - start

    def stop(self) -> float:
        """SIGTERM (a graceful stop: --snapshots saves; without it, SIGTERM's default ends the
        process), wait; the seconds from the signal to the exit."""
        start = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=600)
        seconds = time.perf_counter() - start
        self.out.close()
        if code not in (0, -signal.SIGTERM):
            raise RuntimeError(f"serve exited {code}: {self.log.read_text()[-2000:]}")
        return seconds

    def kill(self) -> None:
        """kill -9 (mlx_lm.server runs in serve's own process): no stop, no save."""
        self.proc.kill()
        self.proc.wait(timeout=600)
        self.out.close()


def spilled_tokens(folder: Path, at_least: int, timeout: float = 600) -> tuple[int, float]:
    """(the most tokens a snapshot of DIR's newest set holds, seconds waited) once a spill while
    serving wrote one of `at_least` tokens (read from its manifest.json, polled)."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        counts = []
        for manifest in folder.glob("set-*/*/manifest.json"):
            try:
                counts.append(json.loads(manifest.read_text())["tokens"]["count"])
            except (OSError, ValueError, KeyError):
                continue  # a set the next spill is removing
        if counts and max(counts) >= at_least:
            return max(counts), time.perf_counter() - start
        time.sleep(0.05)
    raise RuntimeError(f"no spill of {at_least}+ tokens in {folder} after {timeout:.0f} s")


def after_kill(
    ctx: Context, model: Path, server: Server, snaps: Path, turn: tuple, rep: int
) -> dict[str, Any]:
    """`server` (cold: --snapshots on an empty DIR) answered `turn`'s request (msgs, prompt
    tokens): once its spill while serving (on by default) holds that turn, kill -9; then the
    same request is the first of a restarted server: its time, answer, and the share of the
    spilled tokens it reused."""
    msgs, prompt = turn
    spilled, waited = spilled_tokens(snaps, prompt - 1)
    server.kill()
    server = Server(ctx, model, ctx.work / f"snapshots-{rep}-killed.log", snaps)
    first = ask(server.port, msgs)
    server.stop()
    return {
        "spilled_tokens": spilled, "spill_seen_s": waited, "startup_s": server.startup_s,
        "first_s": first[0], "answer": first[1], "prompt": first[2], "cached": first[3],
        "reused": first[3] / spilled,
    }  # fmt: skip


def saved_set(folder: Path) -> dict[str, Any]:
    """The snapshots a stop saved, as `inspect --json` reads each (its JSON contract, not a log
    line): how many, their tokens and bytes."""
    found = sorted({p.parent for p in folder.rglob("manifest.json")})
    if not found:
        raise RuntimeError(f"the stop saved no snapshot in {folder}")
    reports = []
    for snapshot in found:
        cmd = [sys.executable, str(REPO / "build.py"), "inspect", str(snapshot), "--json"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), timeout=300)
        reports.append(json.loads(proc.stdout) if proc.stdout.strip() else {})
        if reports[-1].get("kind") != "snapshot":
            raise RuntimeError(
                f"inspect --json {snapshot}: {proc.stdout[-300:]}{proc.stderr[-300:]}"
            )
    files = sum(sum(r["files"].values()) for r in reports)
    return {
        "saved": len(reports),
        "saved_tokens": sum(r["tokens"]["count"] for r in reports),
        "saved_mib": files / 2**20,
    }


def repetition(ctx: Context, model: Path, notes: list[str], rep: int) -> dict[str, Any]:
    """Fill a --snapshots server with the conversations, stop it (it saves), then the next turn
    of the first conversation after a restart with the snapshots and after one without them (in
    alternating order between repetitions), each followed by its in-memory hit."""
    snaps = ctx.work / f"snapshots-{rep}"
    shutil.rmtree(snaps, ignore_errors=True)
    server = Server(ctx, model, ctx.work / f"snapshots-{rep}-fill.log", snaps)
    answers = [ask(server.port, messages(text, None, QUESTION))[1] for text in notes]
    row: dict[str, Any] = {"stop_s": server.stop(), **saved_set(snaps)}
    # the cold server: --snapshots on an empty DIR of its own (it restores nothing), so that after
    # its hit it is killed (kill -9) once it spilled, and restarted: the "after kill -9" row
    crashed = ctx.work / f"snapshots-{rep}-crash"
    shutil.rmtree(crashed, ignore_errors=True)
    for label in ("with", "without") if rep % 2 == 0 else ("without", "with"):
        log = ctx.work / f"snapshots-{rep}-{label}.log"
        server = Server(ctx, model, log, snaps if label == "with" else crashed)
        msgs = messages(notes[0], answers[0], QUESTION2)
        first = ask(server.port, msgs)
        hit = ask(server.port, messages(notes[0], answers[0], NEXT))
        if label == "with":
            server.stop()
        else:
            row["killed"] = after_kill(ctx, model, server, crashed, (msgs, first[2]), rep)
        row[label] = {
            "startup_s": server.startup_s, "first_s": first[0], "hit_s": hit[0],
            "answer": first[1], "prompt": first[2], "cached": first[3], "hit_cached": hit[3],
        }  # fmt: skip
    if row["with"]["cached"] == 0 or row["without"]["cached"] != 0:  # not as this case says
        raise RuntimeError(
            f"the restart with {snaps} reported 0 cached tokens, or the cold one some"
        )
    row["restore_s"] = row["with"]["startup_s"] - row["without"]["startup_s"]
    return row


def run(ctx: Context) -> dict[str, Any]:
    """Every repetition, summarised."""
    ensure_models()
    model, s = MODEL_F32, settings(ctx.quick)
    notes = [text_with_tokens(model, s["tokens"], seed=41 + i) for i in range(s["conversations"])]
    rows = []
    for rep in range(s["n"]):
        rows.append(repetition(ctx, model, notes, rep))
        w, c = rows[-1]["with"], rows[-1]["without"]
        ctx.note(
            f"snapshots: rep {rep}: first answer after restart {w['first_s']:.3f} s with "
            f"{rows[-1]['saved']} snapshots, {c['first_s']:.3f} s without, hit {w['hit_s']:.3f} s; "
            f"stop {rows[-1]['stop_s']:.2f} s, startup with them {rows[-1]['restore_s']:+.2f} s; "
            f"after kill -9 {rows[-1]['killed']['first_s']:.3f} s, reused "
            f"{rows[-1]['killed']['reused']:.0%} of the spilled tokens"
        )
    summary = {
        "model": model.name, **s, "rows": rows,
        "prompt": rows[0]["with"]["prompt"],
        "stop_s": stat([r["stop_s"] for r in rows]).as_dict(),
        "restore_s": stat([r["restore_s"] for r in rows]).as_dict(),
        "saved_mib": stat([r["saved_mib"] for r in rows]).as_dict(),
        "same_answer": all(r["with"]["answer"] == r["without"]["answer"] for r in rows),
        "killed_same_answer": all(r["killed"]["answer"] == r["without"]["answer"] for r in rows),
    }  # fmt: skip
    for key in ("startup_s", "first_s", "cached", "reused", "spilled_tokens", "spill_seen_s"):
        summary[f"killed_{key}"] = stat([r["killed"][key] for r in rows]).as_dict()
    for label in ("with", "without"):
        for key in ("startup_s", "first_s", "hit_s", "cached"):
            summary[f"{label}_{key}"] = stat([r[label][key] for r in rows]).as_dict()
    return summary


def section(result: dict[str, Any]) -> list[str]:
    """Markdown for RESULTS.md."""

    def cell(key: str, fmt: str = "{:.3f}") -> str:
        v = result[key]
        spread = f" ({fmt.format(v['min'])}–{fmt.format(v['max'])})" if v["n"] > 1 else ""
        return fmt.format(v["median"]) + spread

    w, c = result["with_first_s"]["median"], result["without_first_s"]["median"]
    hit = result["with_hit_s"]["median"]
    return [
        "## Snapshots: the first answer after a restart with `serve --snapshots` vs without, and "
        "vs the in-memory hit",
        "",
        f"mlx_lm.server through `serve` (no bundle), model `{result['model']}` (float32); "
        f"{result['conversations']} conversations of ~{result['tokens']} tokens each (notes no "
        "bundle covers, one question, an 8-token answer), then a graceful stop (SIGTERM) saves them "
        f"as {result['conversations']} snapshots, {cell('saved_mib', '{:.1f}')} MiB of KV in all. "
        "After a restart: the next turn of the first conversation "
        f"({result['prompt']} prompt tokens), with the snapshots restored and without them; then, "
        "in the same process, another next turn on the same history (the in-memory hit). Seconds, "
        f"median (min–max), n={result['n']} restarts each, the two kinds alternating.",
        "",
        "| restart | startup s | first answer s | in-memory hit s | first / hit | cached |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| with snapshots | {cell('with_startup_s', '{:.2f}')} | {cell('with_first_s')} | "
        f"{cell('with_hit_s')} | {ratio(w, hit):.2f}x | {cell('with_cached', '{:.0f}')} |",
        f"| without (cold: an empty DIR) | {cell('without_startup_s', '{:.2f}')} | {cell('without_first_s')} | "
        f"{cell('without_hit_s')} | {ratio(c, result['without_hit_s']['median']):.2f}x | "
        f"{cell('without_cached', '{:.0f}')} |",
        f"| after kill -9 (spilled while serving) | {cell('killed_startup_s', '{:.2f}')} | "
        f"{cell('killed_first_s')} | - | - | {cell('killed_cached', '{:.0f}')} |",
        "",
        f"- first answer after a restart: **{ratio(c, w):.1f}x faster** with the snapshots than "
        f"without; same answer: {result['same_answer']}",
        f"- after `kill -9` (the cold server, once its spill of that next turn was seen in its DIR "
        f"{cell('killed_spill_seen_s', '{:.1f}')} s after the hit's answer, then SIGKILL; the same "
        f"request is the restarted server's first): it reused {cell('killed_reused', '{:.0%}')} of the {cell('killed_spilled_tokens', '{:.0f}')} "
        f"tokens spilled, **{ratio(c, result['killed_first_s']['median']):.1f}x faster** than "
        f"cold; same answer as cold: {result['killed_same_answer']}",
        f"- the stop (SIGTERM to exit, the save included) {cell('stop_s', '{:.2f}')} s; the "
        f"restore (startup with the snapshots minus without) {cell('restore_s', '{:.2f}')} s "
        "(validated, host signature checked, loaded)",
        "",
    ]


if __name__ == "__main__":
    standalone("snapshots", run, section)
