"""`serve --huge-pages`: the re-execution with GLIBC_TUNABLES, and the real server with it on and off."""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
from pathlib import Path

import pytest
from test_serve import cached, chat, server_process

from pipeline.format.bundle_folder import MANIFEST_FILE
from pipeline.runtime import hugepages
from pipeline.runtime.hugepages import (
    REEXEC_MARKER,
    ensure_huge_pages,
    reexec_argv,
    status_line,
    thp_mode,
    unsupported,
    with_tunable,
)

HUGE_PAGES_WORK = unsupported(platform.system(), platform.libc_ver()) is None
SERVE = ["--model", "m", "--huge-pages", "on", "--port", "8080"]


def process_environ(pid: int) -> dict[str, str]:
    """The environment a Linux process was (re-)executed with, from /proc/<pid>/environ."""
    env: dict[str, str] = {}
    name = ""
    for entry in filter(None, Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")):
        if name == "GLIBC_TUNABLES" and entry.startswith("glibc."):
            # glibc parses GLIBC_TUNABLES in place, writing NULs over its ':' separators
            env[name] += ":" + entry
        else:
            name, _, value = entry.partition("=")
            env[name] = value
    return env


def answer_warm(tiny_model: Path, shop_bundle: Path, log: Path, setting: str, env: dict):
    """Start serve with --huge-pages setting; its pid, a warm answer and its log."""
    bundles = shop_bundle.parents[2]
    with server_process(tiny_model, bundles, log, "--huge-pages", setting, env=env) as (proc, port):
        response = chat(port, "Where is my order 12345?")
        environ = process_environ(proc.pid) if sys.platform == "linux" else {}
    prefix_tokens = json.loads((shop_bundle / MANIFEST_FILE).read_text())["tokens"]["count"]
    assert cached(response) >= prefix_tokens - 1
    assert response["choices"][0]["message"]["content"]
    return proc.pid, environ, log.read_text()


# --- the real server ------------------------------------------------------------------------


def test_serve_with_huge_pages_on_runs_with_the_tunable_and_answers_warm(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path
):
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}
    pid, environ, log = answer_warm(tiny_model, shop_bundle, tmp_path / "on.log", "on", env)
    assert log.count("mounted shop@1") == 1  # mounted once: the re-execution came before it
    if not HUGE_PAGES_WORK:
        assert "huge pages: --huge-pages on has no effect" in log
        return
    # the same pid re-executed itself, keeping the tunable it was started with
    assert environ["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1"
    assert environ[REEXEC_MARKER] == str(pid)
    assert "huge pages: on (GLIBC_TUNABLES glibc.malloc.hugetlb=1)" in log
    assert "WARNING - huge pages" not in log


def test_serve_with_huge_pages_off_runs_without_the_tunable_and_answers_warm(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path
):
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    _, environ, log = answer_warm(tiny_model, shop_bundle, tmp_path / "off.log", "off", env)
    assert "huge pages: off; transparent huge pages:" in log
    assert "GLIBC_TUNABLES" not in environ and REEXEC_MARKER not in environ


# --- the re-execution, without executing ------------------------------------------------------


@pytest.mark.parametrize(
    "orig_argv, expected",
    [
        (["python", "build.py", "serve", *SERVE], ["/venv/python", "build.py", "serve", *SERVE]),
        (
            ["python3", "-X", "utf8", "-u", "/srv/app/build.py", "serve", *SERVE],
            ["/venv/python", "-X", "utf8", "-u", "/srv/app/build.py", "serve", *SERVE],
        ),
        (
            ["/venv/python", "/venv/bin/prefix-bundles", "serve", *SERVE],
            ["/venv/python", "/venv/bin/prefix-bundles", "serve", *SERVE],
        ),
        (["python", "-m", "pytest", "-k", "serve"], None),  # serve's main called in-process
        (SERVE, None),  # no interpreter before serve's arguments
    ],
)
def test_reexec_argv_repeats_the_command_line_that_started_serve(orig_argv, expected):
    assert reexec_argv(SERVE, orig_argv, "/venv/python") == expected


def test_no_executable_means_no_reexec():
    assert reexec_argv(SERVE, ["python", "build.py", "serve", *SERVE], "") is None


@pytest.mark.parametrize(
    "tunables, expected",
    [
        (None, "glibc.malloc.hugetlb=1"),
        ("glibc.malloc.arena_max=4", "glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1"),
        (
            "glibc.malloc.hugetlb=0:glibc.malloc.arena_max=4",
            "glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1",
        ),
        ("glibc.malloc.arena_max=4:", "glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1"),
    ],
)
def test_with_tunable_keeps_the_other_tunables_and_the_environment(tunables, expected):
    env = {"PATH": "/bin", **({"GLIBC_TUNABLES": tunables} if tunables else {})}
    before = dict(env)
    assert with_tunable(env, 42) == {
        "PATH": "/bin",
        "GLIBC_TUNABLES": expected,
        REEXEC_MARKER: "42",
    }
    assert env == before


class Executed(Exception):
    """Raised by the fake os.execve: a real one never returns."""


@pytest.mark.parametrize(
    "setting, env, system, libc, executes, expected",
    [
        ("on", {}, "Linux", ("glibc", "2.36"), True, None),
        ("on", {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "Linux", ("glibc", "2.36"), True, None),
        ("on", {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "Linux", ("glibc", "2.36"), False,
         "INFO huge pages: on (GLIBC_TUNABLES glibc.malloc.hugetlb=1); transparent huge pages:"),
        ("on", {REEXEC_MARKER: "PID"}, "Linux", ("glibc", "2.36"), False,
         "WARNING huge pages: --huge-pages on has no effect: GLIBC_TUNABLES was lost re-executing serve; start serve with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 in its environment instead"),
        ("on", {}, "Darwin", ("", ""), False,
         "INFO huge pages: --huge-pages on has no effect on Darwin (Linux with glibc only)"),
        ("on", {}, "Linux", ("", ""), False,
         "INFO huge pages: --huge-pages on has no effect without glibc (libc unknown)"),
        ("on", {}, "Linux", ("glibc", "2.31"), False,
         "INFO huge pages: --huge-pages on has no effect with glibc 2.31 (glibc.malloc.hugetlb needs glibc 2.35+)"),
        ("off", {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "Linux", ("glibc", "2.36"), False,
         "INFO huge pages: on: GLIBC_TUNABLES sets glibc.malloc.hugetlb=1 (--huge-pages off leaves it)"),
        ("off", {}, "Linux", ("glibc", "2.36"), False, "INFO huge pages: off; transparent huge pages:"),
    ],
)  # fmt: skip
def test_ensure_huge_pages_executes_only_when_it_can_help(
    setting, env, system, libc, executes, expected, monkeypatch, caplog
):
    calls = []

    def execve(path, argv, environ):
        calls.append((path, argv, environ))
        raise Executed

    monkeypatch.setattr(hugepages.os, "execve", execve)
    monkeypatch.setattr(hugepages.platform, "system", lambda: system)
    monkeypatch.setattr(hugepages.platform, "libc_ver", lambda: libc)
    monkeypatch.setattr(sys, "orig_argv", ["python", "build.py", "serve", *SERVE])
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value.replace("PID", str(os.getpid())))
    caplog.set_level(logging.DEBUG, logger="prefix-bundles")

    if executes:
        with pytest.raises(Executed):
            ensure_huge_pages(setting, SERVE)
        ((path, argv, environ),) = calls
        assert path == sys.executable and argv == [sys.executable, "build.py", "serve", *SERVE]
        assert environ["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
        assert environ[REEXEC_MARKER] == str(os.getpid())
        return
    ensure_huge_pages(setting, SERVE)
    assert calls == []
    lines = [f"{r.levelname} {r.getMessage()}" for r in caplog.records]
    assert lines[0].startswith(expected), lines
    assert REEXEC_MARKER not in os.environ  # the re-executed process drops its marker


@pytest.mark.parametrize(
    "text, expected",
    [("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"), ("", None)],
)
def test_thp_mode_reads_the_bracketed_mode(text, expected, tmp_path: Path):
    (tmp_path / "enabled").write_text(text)
    assert thp_mode(tmp_path / "enabled") == expected
    assert thp_mode(tmp_path / "missing") is None


def test_status_line_says_when_thp_cannot_help():
    assert status_line("on", "1", "never") == (
        "huge pages: on (GLIBC_TUNABLES glibc.malloc.hugetlb=1); transparent huge pages: "
        "'never', so huge pages cannot help (needs madvise or always)"
    )
    assert status_line("off", None, None) == (
        "huge pages: off; transparent huge pages: not available "
        "(/sys/kernel/mm/transparent_hugepage/enabled unreadable)"
    )
