"""Each wrapped server's first request with bundles and its in-memory hit (case servers' bundle
rows), for this tree and another revision side by side in one run: a serve-layer change must not
make any server slower (issue 37: at most 10 %).

  python bench/servers_against.py REV [--runs N] [--servers mlx_lm.server,vllm-mlx,...]

REV is checked out in a temporary git worktree; each tree builds its own demo bundles (and omni's
own-request-code bundles) with its own builder, and every server process runs that tree's
`pipeline` (PYTHONPATH). Runs alternate between the trees (ABAB..., the order flipped each round)
so that the machine's drift falls on both; the table gives medians, min-max and the ratio of
medians (this tree / REV). Needs the server venvs (tests/envs/make_servers_env.sh,
make_rapid_env.sh) and the demo model (`just demo`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent)]

from case_servers import MODEL, PREFIX, RAPID_VENV, VENV, first_request  # noqa: E402
from common import REPO, clean_env, free_port  # noqa: E402

SERVERS = ("mlx_lm.server", "vllm-mlx", "vllm-mlx-batched", "rapid-mlx", "mlx-omni-server",
           "mlx-openai-server")  # fmt: skip


def build_bundles(tree: Path, work: Path) -> tuple[Path, Path]:
    """The demo's bundles and the support-agent prefix built through omni's own request code."""
    bundles, omni = work / "bundles", work / "omni-bundles"
    env = clean_env(PYTHONPATH=str(tree))
    subprocess.run(
        [sys.executable, str(tree / "build.py"), "--bundles", str(bundles), "demo"],
        check=True, cwd=tree, env=env, capture_output=True,
    )  # fmt: skip
    prefixes = work / "prefixes"
    shutil.copytree(PREFIX, prefixes / PREFIX.name, dirs_exist_ok=True)
    text = (PREFIX.parent / f"{PREFIX.name}.toml").read_text()
    text = text.replace("[template]", 'servers = ["mlx-omni-server"]\n\n[template]', 1)
    text = text.replace('path = "models/demo-tiny"', f"path = {json.dumps(str(MODEL))}")
    (prefixes / f"{PREFIX.name}.toml").write_text(text)
    subprocess.run(
        [str(VENV / "bin" / "python"), str(tree / "build.py"), "--prefixes", str(prefixes),
         "--bundles", str(omni), "build", "--no-check", PREFIX.name],
        check=True, cwd=work, env=env, capture_output=True,
    )  # fmt: skip
    return bundles, omni


def command(server: str, tree: Path, bundles: Path, omni: Path) -> list[str]:
    """The bundle row's command line of case servers, run from `tree`."""
    python = str((RAPID_VENV if server == "rapid-mlx" else VENV) / "bin" / "python")
    if server == "mlx-omni-server":
        app = str(tree / "tests" / "envs" / "omni_chat_app.py")
        return [python, app, "--bundles", str(omni), "serve", "--server", server,
                "--model", str(MODEL)]  # fmt: skip
    named = [] if server == "mlx_lm.server" else ["--server", server.removesuffix("-batched")]
    batched = ["--continuous-batching"] if server == "vllm-mlx-batched" else []
    cli = [python, str(tree / "build.py"), "--bundles", str(bundles), "serve", *named]
    return [*cli, "--model", str(MODEL), *batched]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--servers", default=",".join(SERVERS))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="servers-against-"))
    base = work / "base"
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(base), args.rev], check=True,
                   cwd=REPO)  # fmt: skip
    try:
        # the demo model as this tree has it (generated, git-ignored): the same bytes for both
        shutil.copytree(MODEL, base / MODEL.relative_to(REPO))
        trees = {"this tree": REPO, args.rev: base}
        folders = {}
        for label, tree in trees.items():
            (work / label).mkdir(exist_ok=True)
            folders[label] = build_bundles(tree, work / label)
        rows: dict[str, dict[str, list[dict]]] = {}
        for round_ in range(args.runs):
            for server in args.servers.split(","):
                order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
                for label in order:
                    port = free_port()
                    home = work / "home"
                    shutil.rmtree(home, ignore_errors=True)
                    home.mkdir()
                    cmd = [*command(server, trees[label], *folders[label]), "--port", str(port)]
                    env = clean_env(HOME=str(home), PYTHONPATH=str(trees[label]))
                    log = work / f"{server}-{label.replace(' ', '-')}-{round_}.log"
                    row = first_request(cmd, port, log, env, ())
                    rows.setdefault(server, {}).setdefault(label, []).append(row)
                    print(f"{server} {label} run {round_ + 1}: first {row['first_s']:.3f} s, "
                          f"hit {row['hit_s']:.3f} s", file=sys.stderr, flush=True)  # fmt: skip
        print(table(rows, args.rev, args.runs))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO)
    return 0


def table(rows: dict[str, dict[str, list[dict]]], rev: str, runs: int) -> str:
    def cell(values: list[float]) -> str:
        return f"{median(values):.3f} s ({min(values):.3f}-{max(values):.3f})"

    out = [f"| server | first request: this tree | {rev} | ratio | in-memory hit: this tree "
           f"| {rev} | ratio |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for server, by in rows.items():
        line = [server]
        for key in ("first_s", "hit_s"):
            ours, theirs = ([r[key] for r in by[label]] for label in ("this tree", rev))
            line += [cell(ours), cell(theirs), f"{median(ours) / median(theirs):.2f}x"]
        out.append("| " + " | ".join(line) + " |")
    return "\n".join([*out, "", f"n = {runs} per tree and server, alternating."])


if __name__ == "__main__":
    sys.exit(main())
