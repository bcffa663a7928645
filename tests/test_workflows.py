"""CI workflows and deploy examples: every `build.py` command they run exists with those options.

The commands are read from the files themselves (workflow `run:` steps with their env and matrix
expressions, examples/deploy.sh, the systemd unit's ExecStart=) and parsed with the CLI's own
parsers, so a renamed command or option fails here, not in a release. deploy.sh runs for real.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import io
import itertools
import json
import os
import re
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from pipeline.cli import setup_arg_parser
from pipeline.cli.reports import BuiltTarget
from pipeline.format.bundle_folder import CACHE_FILE

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"
DEPLOY = ROOT / "examples" / "deploy.sh"
UNIT = ROOT / "examples" / "prefix-bundles-serve.service"
PLACEHOLDER = "X"  # what an input, secret or shell variable stands for
EXPRESSION = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")
VARIABLE = re.compile(r"^\$(?:(\w+)|\{(\w+)\})$")
OPERATORS = ";&|<>()"


@dataclass(frozen=True)
class Invocation:
    where: str
    argv: tuple[str, ...]  # what follows build.py


# --- reading the commands ------------------------------------------------------------------


def build_py_argv(line: str, env: dict[str, str]) -> tuple[str, ...] | None:
    """The arguments after `build.py` on one shell line, variables expanded; None if no build.py."""
    if "build.py" not in line:
        return None
    lexer = shlex.shlex(line, posix=True, punctuation_chars=OPERATORS)
    lexer.whitespace_split = True
    tokens = list(lexer)
    starts = [i for i, t in enumerate(tokens) if t == "build.py" or t.endswith("/build.py")]
    if not starts:
        return None
    argv: list[str] = []
    for token in tokens[starts[0] + 1 :]:
        if set(token) <= set(OPERATORS):
            if token[0] in "<>" and argv and argv[-1].isdigit():
                argv.pop()  # the fd of `2>`
            break
        argv.append(_expand(token, env))
    return tuple(argv)


def _expand(token: str, env: dict[str, str]) -> str:
    match = VARIABLE.match(token)
    if match:
        return env.get(match[1] or match[2], PLACEHOLDER)
    return PLACEHOLDER if "$" in token else token  # arrays, slices, command substitutions


def _script_lines(script: str) -> list[str]:
    return script.replace("\\\n", " ").splitlines()


def matrix_combinations(job: dict) -> list[dict]:
    matrix = (job.get("strategy") or {}).get("matrix") or {}
    axes = {k: v for k, v in matrix.items() if k not in ("include", "exclude")}
    product = [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]
    return (product if axes else []) + list(matrix.get("include", [])) or [{}]


def _evaluate(text: str, combination: dict, total: int) -> str:
    """Matrix values and strategy.job-total as GitHub substitutes them; anything else a placeholder."""

    def value(match: re.Match) -> str:
        expression = match[1]
        if expression.startswith("matrix."):
            return str(combination[expression.removeprefix("matrix.")])
        return str(total) if expression == "strategy.job-total" else PLACEHOLDER

    return EXPRESSION.sub(value, text)


def workflow_invocations(path: Path) -> Iterator[Invocation]:
    workflow = yaml.safe_load(path.read_text(encoding="utf-8"))
    for job_id, job in workflow["jobs"].items():
        combinations = matrix_combinations(job)
        for combination, (n, step) in itertools.product(combinations, enumerate(job["steps"])):
            if "run" not in step:
                continue
            scopes = (workflow.get("env"), job.get("env"), step.get("env"))
            env = {
                k: _evaluate(str(v), combination, len(combinations))
                for scope in scopes
                for k, v in (scope or {}).items()
            }
            script = _evaluate(step["run"], combination, len(combinations))
            for line in _script_lines(script):
                argv = build_py_argv(line, env)
                if argv is not None:
                    where = f"{path.name} job {job_id} {combination} step {step.get('name', n)!r}"
                    yield Invocation(where, argv)


def example_invocations() -> Iterator[Invocation]:
    for line in _script_lines(DEPLOY.read_text(encoding="utf-8")):
        argv = build_py_argv(line, {})
        if argv is not None:
            yield Invocation(DEPLOY.name, argv)
    for line in UNIT.read_text(encoding="utf-8").splitlines():
        if line.startswith("ExecStart="):
            argv = build_py_argv(line.removeprefix("ExecStart="), {})
            if argv is not None:
                yield Invocation(UNIT.name, argv)


def all_invocations() -> list[Invocation]:
    workflows = sorted(WORKFLOWS.glob("*.yml"))
    return [i for w in workflows for i in workflow_invocations(w)] + list(example_invocations())


# --- checking them against the CLI ----------------------------------------------------------


def problem(argv: tuple[str, ...]) -> str | None:
    """Why the CLI would not accept argv (unknown command, option or value), or None."""
    command, *args = argv or ("",)
    if command == "serve":
        return _serve_problem(args)
    parser = setup_arg_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if command not in commands.choices:
        return f"no command {command!r} (have: {', '.join(commands.choices)})"
    known = commands.choices[command]._option_string_actions
    unknown = [a.split("=", 1)[0] for a in args if a.startswith("-")]
    unknown = [a for a in unknown if a not in known]
    if unknown:
        return f"{command} has no option {', '.join(unknown)}"
    return _parse_problem(parser.parse_args, [command, *args])


def _serve_problem(args: list[str]) -> str | None:
    parsed = []
    error = _parse_problem(
        lambda a: parsed.extend(setup_arg_parser().parse_known_args(["serve", *a])[1]), args
    )
    unknown = [a.split("=", 1)[0] for a in parsed if a.startswith("-")]
    unknown = [a for a in unknown if a not in mlx_lm_server_options()]
    if unknown:
        return f"neither serve nor mlx_lm.server has the option {', '.join(unknown)}"
    return error


def _parse_problem(parse, args: list[str]) -> str | None:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parse(args)
    except SystemExit:
        return "argparse refused it: " + stderr.getvalue().strip().splitlines()[-1]
    return None


@functools.cache
def mlx_lm_server_options() -> frozenset[str]:
    """The options `serve` passes through to mlx_lm.server, from its own --help."""
    help_text = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "server", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return frozenset(re.findall(r"--[\w-]+", help_text))


# --- tests ---------------------------------------------------------------------------------


def test_every_build_py_command_in_workflows_and_examples_exists_with_its_options():
    problems = [
        f"{i.where}: build.py {shlex.join(i.argv)}: {p}"
        for i in all_invocations()
        if (p := problem(i.argv)) is not None
    ]
    assert problems == []


def test_the_scan_finds_what_each_file_runs():
    release = list(workflow_invocations(WORKFLOWS / "release-bundles.yml"))
    assert {i.argv[0] for i in release} == {"build", "verify", "demo-model", "sign", "push"}
    builds = [i.argv for i in release if i.argv[0] == "build"]
    assert all({"--locked", "--json"} <= set(argv) for argv in builds)
    shards = sorted(argv[argv.index("--shard") + 1] for argv in builds)
    assert shards == ["1/2", "2/2"]  # the matrix covers every shard of N, each once
    deploy = [i.argv for i in example_invocations() if i.where == DEPLOY.name]
    # the copy route verifies its staged copy; the registry route pulls, then verifies in place
    assert deploy[0] == ("verify", "--json", "--model", PLACEHOLDER, "--bundles", PLACEHOLDER)
    assert deploy[-1] == ("verify", "--json", "--model", PLACEHOLDER)
    assert {d[:5] for d in deploy[1:-1]} == {
        ("pull", "--repo", PLACEHOLDER, "--model", PLACEHOLDER)
    }
    examples = {i.where: i.argv for i in example_invocations()}
    assert examples[UNIT.name][:3] == ("serve", "--model", "/srv/models/Qwen3-0.6B")
    assert "--strict" in examples[UNIT.name]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (("frobnicate",), "no command 'frobnicate'"),
        (("build", "--no-such-option"), "build has no option --no-such-option"),
        (("build", "--locked=yes"), "argparse refused it"),
        (("verify", "--json"), "argparse refused it"),  # --model is required
        (("serve", "--strict"), "argparse refused it"),  # so is serve's
        (("serve", "--model", "m", "--no-such-option"), "neither serve nor mlx_lm.server"),
    ],
)
def test_the_check_refuses_what_the_cli_would(argv: tuple[str, ...], expected: str):
    assert expected in (problem(argv) or "")


def test_check_passes_mlx_lm_server_options_through():
    assert problem(("serve", "--model", "m", "--port", "8080", "--host", "127.0.0.1")) is None


def test_test_workflow_installs_and_tests_as_the_readme_says():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "pip install -e '.[dev]'" in readme and "just test" in readme
    job = yaml.safe_load((WORKFLOWS / "test.yml").read_text(encoding="utf-8"))["jobs"]["test"]
    runs = [step.get("run", "") for step in job["steps"]]
    assert "python -m pip install -e '.[dev]'" in runs and "just test" in runs
    runners = {c["os"] for c in matrix_combinations(job)}
    assert "ubuntu-latest" in runners and any(r.startswith("macos-1") for r in runners)


# --- .github/scripts/release.py (the release workflow's helper) -------------------------------

RELEASE = runpy.run_path(str(ROOT / ".github" / "scripts" / "release.py"))
REVISION = "a" * 40


def test_release_models_key_changes_with_the_pinned_hub_revisions(project: Path, monkeypatch):
    monkeypatch.chdir(project)
    local_only = RELEASE["models"]([])
    toml = project / "prefixes" / "shop.toml"
    toml.write_text(toml.read_text() + f'\n[[models]]\nrepo = "acme/m"\nrevision = "{REVISION}"\n')
    pinned = RELEASE["models"](["shop"])
    toml.write_text(toml.read_text().replace(REVISION, "b" * 40))
    repinned = RELEASE["models"]([])
    assert local_only[0] == "hub-models=" and pinned[0] == f"hub-models=acme/m@{REVISION}"
    assert len({local_only[1], pinned[1], repinned[1]}) == 3  # hub-key=...
    assert local_only[2] == pinned[2] == "demo-model=false"


def test_release_verify_groups_and_summary_read_build_json(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    target = dict(prefix="shop", version=1, model=str(tiny_model), status="built",
                  path=str(shop_bundle), tokens=1234, bytes=56789, prefill_seconds=0.5,
                  tokens_per_second=2468.0, reused_tokens=1024, error=None)  # fmt: skip
    assert set(target) == set(BuiltTarget.model_fields)  # the build/1 document's fields
    failed = {**target, "status": "failed", "path": None, "tokens": None, "bytes": None,
              "prefill_seconds": None, "reused_tokens": None, "error": "no space"}  # fmt: skip
    report = tmp_path / "build.json"
    report.write_text(json.dumps({"targets": [target, failed], "error": "no space"}))
    assert RELEASE["verify_groups"](report) == [f"{tiny_model.resolve()}\t{shop_bundle}"]
    assert RELEASE["summary"]([report])[2:] == [
        f"| shop@1 | `{tiny_model}` | built | 1,234 | 1,024 | 56,789 | 0.50 |",
        f"| shop@1 | `{tiny_model}` | failed | – | – | – | – |",
        "",
        f"**{report}**: `error: no space`",
    ]


# --- deploy.sh, for real, on this machine -----------------------------------------------------


def _deploy(bundles: Path | str, model: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PROJECT": str(ROOT), "PYTHON": sys.executable, "SERVICE": ""}
    return subprocess.run(
        ["bash", str(DEPLOY), str(bundles), str(model)], env=env, capture_output=True, text=True
    )


@pytest.mark.skipif(
    shutil.which("rsync") is None or sys.platform != "linux",
    reason="deploy.sh targets Linux hosts (GNU cp -al) and needs rsync",
)
def test_deploy_copies_verifies_and_puts_back_the_old_bundles_on_a_refusal(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path
):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    deployed = model / "prefix-bundles" / shop_bundle.relative_to(shop_bundle.parents[2])
    done = _deploy(shop_bundle.parents[2], model)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["totals"] == {"ok": 1, "refused": 0}
    good = hashlib.sha256((deployed / CACHE_FILE).read_bytes()).hexdigest()

    bad = tmp_path / "bad"
    shutil.copytree(shop_bundle.parents[2], bad)
    with open(bad / deployed.relative_to(model / "prefix-bundles") / CACHE_FILE, "ab") as f:
        f.write(b"\0")
    refused = _deploy(bad, model)
    assert refused.returncode == 1
    assert "error: verify refused a bundle" in refused.stderr
    assert json.loads(refused.stdout)["totals"] == {"ok": 0, "refused": 1}
    assert hashlib.sha256((deployed / CACHE_FILE).read_bytes()).hexdigest() == good
    assert (model / ".prefix-bundles.failed").is_dir()
    assert not (model / ".prefix-bundles.previous").exists()
    assert not (model / ".prefix-bundles.next").exists()


@pytest.mark.skipif(
    shutil.which("rsync") is None or sys.platform != "linux",
    reason="deploy.sh targets Linux hosts (GNU cp -al) and needs rsync",
)
def test_a_deploy_stopped_half_way_leaves_the_live_bundles_whole(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path
):
    """rsync copied into the live folder: a deploy stopped mid-copy (Ctrl-C, a lost ssh) left
    it half updated (a bundle without its cache file; a restart with --strict failed). The copy
    goes to a staged folder verified before two renames swap it in; a run stopped between the
    renames is put right by the next run."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    assert _deploy(shop_bundle.parents[2], model).returncode == 0
    live = model / "prefix-bundles"
    before = sorted(p.relative_to(live) for p in live.rglob("*"))
    env = {**os.environ, "PROJECT": str(ROOT), "PYTHON": sys.executable, "SERVICE": ""}
    slow = tmp_path / "bin"
    slow.mkdir()
    (slow / "rsync").write_text(f'#!/bin/sh\n{shutil.which("rsync")} --bwlimit=1 "$@"\n')
    (slow / "rsync").chmod(0o755)
    bigger = tmp_path / "new"
    shutil.copytree(shop_bundle.parents[2], bigger)
    (bigger / "shop" / "2").mkdir()
    shutil.copytree(shop_bundle, bigger / "shop" / "2" / shop_bundle.name)
    proc = subprocess.Popen(
        ["bash", str(DEPLOY), str(bigger), str(model)],
        env={**env, "PATH": f"{slow}:{env['PATH']}"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    time.sleep(2)  # mid-copy at 1 KB/s
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=30)
    assert sorted(p.relative_to(live) for p in live.rglob("*")) == before
    # stopped between the renames: no live folder, the old one beside it; the next run restores
    (model / "prefix-bundles").rename(model / ".prefix-bundles.previous")
    done = _deploy(shop_bundle.parents[2], model)
    assert done.returncode == 0, done.stderr
    assert sorted(p.relative_to(live) for p in live.rglob("*")) == before


@pytest.mark.skipif(
    shutil.which("rsync") is None or sys.platform != "linux",
    reason="deploy.sh targets Linux hosts (GNU cp -al) and needs rsync",
)
def test_deploy_from_a_registry_pulls_verifies_and_keeps_the_old_bundles_on_a_failure(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path
):
    """The registry route: CI pushed to a real docker-registry on loopback; deploy.sh pulls on
    the target (only new blocks move, published atomically), then verifies."""
    from registry_env import registry

    from pipeline.cli import main

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    deployed = model / "prefix-bundles" / shop_bundle.relative_to(shop_bundle.parents[2])
    with registry(tmp_path / "registry") as reg:
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["push", str(shop_bundle), "--repo", reg.repo()]) == 0
        done = _deploy(reg.repo(), model)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["totals"] == {"ok": 1, "refused": 0}
        assert (deployed / CACHE_FILE).read_bytes() == (shop_bundle / CACHE_FILE).read_bytes()
        failed = _deploy(reg.repo("fleet/empty"), model)  # nothing there for this model
    assert failed.returncode == 1
    assert "error: pull failed" in failed.stderr and "the server was not told" in failed.stderr
    assert (deployed / CACHE_FILE).is_file() and not (model / ".prefix-bundles.previous").exists()
