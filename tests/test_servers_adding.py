"""Adding a server is one room and one registry line (docs/architecture.md): a stub sixth server,
its room in a temporary package and its line added to the registry, is served by `serve --server`,
made by `server-env`, and has its options checked, with no other module changed."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from servers_env import free_port

from pipeline.cli import main
from pipeline.format.errors import PipelineError

ROOM = """
from pipeline.runtime.servers.hook import SERVING, ServerHook

CALLS = []


class Hook(ServerHook):
    name, package, address, snapshots = "stub-server", "json", ("127.0.0.1", 1), True
    distribution, extra, serving = "stub-server==1.0", "stub-server", (*SERVING, "stub-dep")
    proves, ships, reads = ("json",), ("stub_server_pkg",), ("--stub-level",)
    warm_up = False

    @staticmethod
    def request_ids(tokenizer, body, model_type):
        kwargs = body.get("chat_template_kwargs") or {}
        return list(tokenizer.apply_chat_template(
            body["messages"], tools=body.get("tools"), add_generation_prompt=True, **kwargs
        ))

    def install(self, mounted, options, snapshots=None):
        CALLS.append(("install", [b.name for b in mounted.result.bundles]))

    def launch(self, mounted, options):
        CALLS.append(("launch", options.passed("--stub-level")))
        return 0
"""


@pytest.fixture
def stub_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A sixth server: its room (a package of its own) and its registry line, nothing else."""
    from pipeline.runtime.servers import registry

    room = tmp_path / "rooms" / "stub_server"
    room.mkdir(parents=True)
    (room / "__init__.py").write_text(textwrap.dedent(ROOM))
    monkeypatch.syspath_prepend(str(room.parent))
    monkeypatch.setitem(registry.ROOMS, "stub-server", "stub_server")
    parser_cache().cache_clear()  # the command line reads the registry when it is built
    yield sys.modules.get("stub_server") or __import__("stub_server")
    sys.modules.pop("stub_server", None)
    parser_cache().cache_clear()


def parser_cache():
    """The CLI's parser, built once per process (pipeline.cli._parser)."""
    import pipeline.cli

    return pipeline.cli._parser


def test_serve_runs_a_sixth_server_through_the_one_start_up(
    stub_server, shop_bundle: Path, tiny_model: Path, capsys
):
    argv = ["serve", "--server", "stub-server", "--model", str(tiny_model), "--bundles",
            str(shop_bundle.parents[2]), "--port", str(free_port()), "--stub-level", "3"]  # fmt: skip
    assert main(argv) == 0
    assert stub_server.CALLS == [("install", ["shop@1"]), ("launch", "3")]


def test_its_options_are_read_and_checked_for_abbreviations(stub_server):
    from pipeline.runtime.servers.options import read_options, refuse_options
    from pipeline.runtime.servers.tokens import request_code_servers

    assert "--stub-level" in read_options() and "stub-server" in request_code_servers()
    with pytest.raises(PipelineError, match="--stub-lev abbreviates --stub-level"):
        refuse_options(["--stub-lev", "3"], "mlx-lm", {})


def test_server_env_makes_its_venv_from_its_hook(stub_server, tmp_path: Path, capsys):
    venv = tmp_path / "venv"
    assert main(["server-env", "stub-server", str(venv), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.endswith("'xxhash>=3.6,<4' stub-dep") for line in lines)
    assert any(line.endswith("--no-deps stub-server==1.0") for line in lines)
    assert not venv.exists()
