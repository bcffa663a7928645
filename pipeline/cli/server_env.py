"""`server-env`: the virtual environment a wrapped server runs in.

vllm-mlx, mlx-omni-server, mlx-openai-server and rapid-mlx pin mlx-lm >=0.31,<0.32 while this tool
runs on 0.32, so each runs from a venv of its own: mlx-lm 0.31 over the packages of the Python that
runs this command (mlx, transformers: --system-site-packages, plus this environment's own
site-packages when it is itself a venv), the server without its dependencies (vllm-mlx's pull in
CUDA torch; omni's and mlx-openai-server's fail on Linux: mflux needs a CUDA mlx), what its serving
path imports, and this project. The pins are the versions CI tests (docs/servers.md), declared by
each server's hook (pipeline.runtime.servers.registry).
"""

from __future__ import annotations

import argparse
import difflib
import json
import shlex
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

from pipeline import __version__
from pipeline.cli.common import add_json_option, emit_json, note, say
from pipeline.format.errors import PipelineError, UsageError
from pipeline.runtime.servers.registry import ROOMS, clash, hook_class, installed_apart

MLX_LM = "mlx-lm>=0.31.3,<0.32"
# each server's pin, serving needs and proof are its hook's declarations (the registry's list)
PTH_FILE = "prefix-bundles-base.pth"


def add_parser(sub: argparse._SubParsersAction, parents: list) -> None:
    p = sub.add_parser(
        "server-env",
        parents=parents,
        help="make the virtual environment a wrapped server runs in (its pinned versions)",
        description="Make DIR a virtual environment for `serve --server NAME`: mlx-lm 0.31 (the "
        "servers pin <0.32), the server at the version CI tests, what its serving path imports, "
        "and this project; then run DIR/bin/prefix-bundles serve --server NAME ... An existing "
        "DIR that already imports them is kept.",
    )
    p.add_argument(
        "server",
        nargs="+",
        metavar="NAME",
        help=f"one or more of {', '.join(installed_apart())} (two whose packages clash each "
        "need a venv of their own)",
    )
    p.add_argument("dir", type=Path, metavar="DIR", help="the virtual environment to make")
    p.add_argument(
        "--dry-run", action="store_true", help="print the commands; run and write nothing"
    )
    p.add_argument(
        "--replace",
        action="store_true",
        help="remove DIR first when it is a virtual environment that lacks them (default: refuse)",
    )
    add_json_option(p, "server-env", "; pip's own output goes to stderr too")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    servers = checked_servers(args.server)
    venv = Path(args.dir)
    commands = plan(servers, venv)
    # the dry run checks DIR as the run does: it refuses (or finds ready) what the run would
    if (venv / "bin" / "python").exists() and (versions := _imports(servers, venv)) is not None:
        if args.json:
            return _emit(venv, servers, commands, "ready", versions)
        say(f"{venv} already has {', '.join(servers)} ({versions}); nothing to do")
        return 0
    _check_replaceable(venv, args.replace)
    if args.dry_run:
        return _dry_run(args, venv, servers, commands)
    if venv.exists():
        shutil.rmtree(venv)
    for command in commands:
        note(f"running {shell_line(command)}")
        if command[0] == "write-pth":
            _write_pth(Path(command[1]), command[2:])
        elif subprocess.run(command, stdout=sys.stderr if args.json else None).returncode != 0:
            raise PipelineError(
                f"server-env: {shlex.join(command[:6])} ... failed (its output is above); "
                f"fix that and run the command again with --replace"
            )
    versions = _imports(servers, venv)
    if versions is None:
        raise PipelineError(
            f"server-env: {venv} was made but does not import {', '.join(servers)}: run "
            f"{venv}/bin/python -c 'import {hook_class(servers[0]).proves[0]}' to see why"
        )
    if args.json:
        return _emit(venv, servers, commands, "made", versions)
    say(
        f"made {venv} ({versions}): run {venv}/bin/prefix-bundles serve --server {servers[0]} "
        "--model DIR ..."
    )
    return 0


def _dry_run(args: argparse.Namespace, venv: Path, servers: list[str], commands: list) -> int:
    """The commands the run would run, printed (or as JSON); nothing is run or written."""
    if venv.exists():
        note(f"--replace: the run removes {venv} first")
    if args.json:
        return _emit(venv, servers, commands, "dry-run", None)
    for command in commands:
        print(shell_line(command))
    return 0


def _emit(venv: Path, servers: list[str], commands: list, status: str, versions) -> int:
    from pipeline.cli.reports import ServerEnvReport

    lines = [shell_line(c) for c in commands]
    emit_json(
        ServerEnvReport(
            dir=str(venv), servers=servers, status=status, commands=lines, versions=versions
        )
    )
    return 0


def checked_servers(names: list[str]) -> list[str]:
    """The server names, each known (with a did-you-mean) and none that must live apart."""
    known = installed_apart()
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            guess = f"; did you mean '{close[0]}'?" if close else ""
            here = f"; {name} needs none: it runs in this environment" if name in ROOMS else ""
            raise UsageError(
                f"server-env: unknown server {name!r}; choose from {', '.join(known)}"
                f"{here or guess}"
            )
    chosen = list(dict.fromkeys(names))
    for i, name in enumerate(chosen):
        for other in chosen[:i]:
            if shared := clash(other, name):
                a, b = sorted((other, name), key=known.index)
                raise UsageError(
                    f"server-env: {a} and {b} cannot share a virtual environment (both ship a "
                    f"package named {', '.join(sorted(shared))}); make one for each"
                )
    return chosen


def plan(servers: list[str], venv: Path) -> list[list[str]]:
    """The commands that make the venv, in order (`write-pth`: a file this command writes)."""
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    needs = list(dict.fromkeys(n for s in servers for n in hook_class(s).serving))
    commands = [[sys.executable, "-m", "venv", "--system-site-packages", str(venv)]]
    if sys.prefix != sys.base_prefix:  # a venv's --system-site-packages are its base's, not ours
        commands.append(["write-pth", str(_site_packages(venv)), *_own_site_packages()])
    commands.append([*pip, MLX_LM, *needs])
    commands.append([*pip, "--no-deps", *(hook_class(s).distribution for s in servers)])
    commands.append([*pip, "--no-deps", *_this_project()])
    return commands


def shell_line(command: list[str]) -> str:
    """A command as a shell line (`write-pth FILE FOLDER...`: the printf that writes it)."""
    if command[0] == "write-pth":
        folders = " ".join(shlex.quote(f) for f in command[2:])
        return f"printf '%s\\n' {folders} > {shlex.quote(command[1])}"
    return shlex.join(command)


def _this_project() -> list[str]:
    """How to install this very project: its source folder when installed from one, else its
    release."""
    try:
        url = json.loads(metadata.distribution("mlx-prefix-bundles").read_text("direct_url.json"))
    except (metadata.PackageNotFoundError, TypeError, ValueError):
        url = None
    if isinstance(url, dict) and str(url.get("url", "")).startswith("file://"):
        path = url["url"].removeprefix("file://")
        return ["-e", path] if url.get("dir_info", {}).get("editable") else [path]
    return [f"mlx-prefix-bundles=={__version__}"]


def _own_site_packages() -> list[str]:
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def _site_packages(venv: Path) -> Path:
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return venv / "lib" / version / "site-packages" / PTH_FILE


def _write_pth(path: Path, folders: list[str]) -> None:
    """This environment's site-packages after the venv's own: its mlx-lm 0.31 comes first."""
    path.write_text("".join(f"{f}\n" for f in folders), encoding="utf-8")


def _check_replaceable(venv: Path, replace: bool) -> None:
    """Refuse a DIR that exists, unless --replace and it is a venv (the run then removes it)."""
    if not venv.exists():
        return
    if not replace:
        raise PipelineError(
            f"server-env: {venv} exists but does not import what the servers need; pass "
            "--replace to make it again, or name another DIR"
        )
    if not (venv / "pyvenv.cfg").is_file():
        raise PipelineError(
            f"server-env: {venv} exists and is not a virtual environment (no pyvenv.cfg); "
            "it was left as it is: name another DIR"
        )


def check_script(servers: list[str]) -> str:
    """Python that proves the venv: mlx-lm 0.31, each server's modules and its hook import."""
    modules = [m for s in servers for m in hook_class(s).proves] + [ROOMS[s] for s in servers]
    names = ["mlx-lm", *(hook_class(s).distribution.split("==")[0] for s in servers)]
    return "\n".join(
        [
            "import importlib",
            "from importlib import metadata",
            "import mlx_lm",
            "assert mlx_lm.__version__.startswith('0.31.'), mlx_lm.__version__",
            f"for m in {modules!r}:",
            "    importlib.import_module(m)",
            f"print(', '.join(f'{{n}} {{metadata.version(n)}}' for n in {names!r}))",
        ]
    )


def _imports(servers: list[str], venv: Path) -> str | None:
    """The venv's versions ('mlx-lm 0.31.3, rapid-mlx 0.16.10') when its Python imports
    everything, else None."""
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-B", "-c", check_script(servers)],  # -B: writes nothing
        capture_output=True,
        text=True,
    )
    lines = proc.stdout.strip().splitlines()
    return lines[-1] if proc.returncode == 0 and lines else None
