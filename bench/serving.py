"""What the server cases (servers, concurrency) share: the demo model and its support-agent prefix,
the request bodies, which venv runs each server of the registry, each server's commands (its own
plain one as its hook declares it, and serve's), and the one support-agent bundle both serve.

The servers come from `pipeline.runtime.servers.registry` (ROOMS, names(), each room's Hook); the
venvs are the ones tests/envs/make_servers_env.sh and make_rapid_env.sh make (env variables as the
tests read them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from common import REPO, Context, clean_env

MODEL = REPO / "models" / "demo-tiny"
VENV = Path(os.environ.get("PREFIX_BUNDLES_SERVERS_VENV", REPO / ".venv-servers"))
RAPID_VENV = Path(os.environ.get("PREFIX_BUNDLES_RAPID_VENV", REPO / ".venv-rapid"))
VENVS = (VENV, RAPID_VENV)
PREFIX = REPO / "prefixes" / "support-agent"
QUESTION = "My 2FA codes stopped working after I changed phones. How do I get back in?"
# the in-memory hit: the next client's question on the same prefix (a warm server has the prefix,
# never this question); about the same length as QUESTION
NEXT_QUESTION = "I was charged twice for my annual plan this month. Can you refund one of them?"
# omni's full app does not import on Linux (its image and audio routes need mflux): its chat route
# behind serve's preparation stands in for `mlx-omni-server` (and, with no bundle, for its plain run)
OMNI_APP = REPO / "tests" / "envs" / "omni_chat_app.py"
# --quick: the prefix shortened (the system text's first lines up to this many characters, and the
# first tools): about 2,000 tokens instead of 11,052, so that a cold run and the build take seconds
QUICK_SYSTEM_CHARS, QUICK_TOOLS = 2000, 2


def system_text(quick: bool = False) -> str:
    """The support-agent system text (--quick: its first lines, QUICK_SYSTEM_CHARS at most)."""
    text = (PREFIX / "system.md").read_text()
    return text[: text[:QUICK_SYSTEM_CHARS].rfind("\n") + 1] if quick else text


def tools(quick: bool = False) -> list[dict[str, Any]]:
    """The support-agent tools (--quick: the first QUICK_TOOLS)."""
    found = json.loads((PREFIX / "tools.json").read_text())
    return found[:QUICK_TOOLS] if quick else found


def request_body(kind: str = "full", quick: bool = False) -> dict[str, Any]:
    """The support-agent prefix (system text + 8 tools; `quick`: shortened) and one question,
    temperature 0; "next" asks the next question instead; "system" leaves the tools out;
    "anthropic" is the same request as an Anthropic messages body."""
    question = NEXT_QUESTION if kind == "next" else QUESTION
    system, functions = system_text(quick), tools(quick)
    if kind == "anthropic":
        return {
            "model": str(MODEL),
            "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": question}],
            "tools": [
                {
                    "name": t["function"]["name"],
                    "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"],
                }
                for t in functions
            ],
            "max_tokens": 8,
            "temperature": 0.0,
        }
    body = {
        "model": str(MODEL),
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": 8,
        "temperature": 0.0,
    }
    return body if kind == "system" else {**body, "tools": functions}


def venv_of(server: str) -> Path | None:
    """The venv that runs `server`: the first of VENVS holding its hook's pinned distribution
    (a server that runs in this environment, mlx-lm: the server venv, so that every server runs
    the same mlx-lm); None when none is made here."""
    from importlib.metadata import distributions

    from pipeline.runtime.servers.registry import hook_class

    pin = hook_class(server).distribution
    for venv in VENVS:
        if not (venv / "bin" / "python").exists():
            continue
        if pin is None:
            return venv
        name, version = pin.split("==")
        found = distributions(path=[str(p) for p in venv.glob("lib/python*/site-packages")])
        wanted = name.replace("-", "_").lower()
        if any(
            (d.metadata["Name"] or "").replace("-", "_").lower() == wanted and d.version == version
            for d in found
        ):
            return venv
    return None


def plain(server: str, venv: Path) -> list[str] | None:
    """The server's own command as its hook declares it (`plain`), from the venv's scripts; None
    where it cannot run here (mlx-omni-server: its full app)."""
    from pipeline.runtime.servers.registry import hook_class

    if server == "mlx-omni-server":
        return None
    script, *args = hook_class(server).plain
    return [str(venv / "bin" / script), *(a.format(model=MODEL) for a in args)]


def serve(server: str, venv: Path, bundles: Path, *options: str) -> list[str]:
    """`serve --server NAME [OPTIONS]` on the demo model from the venv (omni: its chat route)."""
    python = str(venv / "bin" / "python")
    entry = OMNI_APP if server == "mlx-omni-server" else REPO / "build.py"
    named = [*options, "--server", server, "--model", str(MODEL)]
    return [python, str(entry), "--bundles", str(bundles), "serve", *named]


def demo_project(ctx: Context, name: str) -> Path:
    """The repo's prefixes beside the demo model (generated when missing), under WORK/name."""
    from pipeline.testmodels.model import generate_model

    generate_model(MODEL, "tiny")  # as `build.py demo` makes it; kept when present
    project = ctx.work / name
    shutil.rmtree(project, ignore_errors=True)
    shutil.copytree(REPO / "prefixes", project / "prefixes")
    (project / "models").mkdir()
    (project / "models" / MODEL.name).symlink_to(MODEL)
    return project


def build(project: Path, python: str, *options: str) -> Path:
    """`build support-agent` in the project; its bundles folder."""
    cli = [python, str(REPO / "build.py"), "--prefixes", str(project / "prefixes")]
    proc = subprocess.run(
        [*cli, "--bundles", str(project / "bundles"), "build", *options, PREFIX.name],
        cwd=project,
        env=clean_env(),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"build {PREFIX.name} failed: {proc.stderr.strip()[-2000:]}")
    return project / "bundles"


def bundles(ctx: Context) -> str | None:
    """The support-agent bundle on the demo model, built once for the server cases (fidelity
    check on as the CLI ships; --quick: the shortened prefix, no check); None (said) when no
    server venv is made here."""
    if not (VENV / "bin" / "python").exists():
        ctx.note(f"servers: skipped, no server venv at {VENV} (tests/envs/make_servers_env.sh)")
        return None
    project = demo_project(ctx, "servers-project")
    if ctx.quick:  # the definition reads these files: the shortened prefix request_body sends
        (project / "prefixes" / "prefixes.lock").unlink()  # it pins the full prefix's content
        copy = project / "prefixes" / PREFIX.name
        (copy / "system.md").write_text(system_text(quick=True))
        (copy / "tools.json").write_text(json.dumps(tools(quick=True), indent=2) + "\n")
    ctx.note(
        f"servers: building {PREFIX.name}{' (shortened)' if ctx.quick else ''} on {MODEL.name}"
    )
    return str(build(project, sys.executable, *(["--no-check"] if ctx.quick else [])))
