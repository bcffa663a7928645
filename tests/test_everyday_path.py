"""The everyday path after the quick start (issue 50): usage errors exit 2 whoever finds them, a
mistyped command is named with the nearest one, `new` starts a project in an empty folder, and
every hint names the command as it was invoked."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pipeline.cli import main


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["serve", "--port", "abc"], "--port 'abc' is not a port number"),
        (["serve", "--port", "99999"], "--port '99999' is not a port number"),
        (["serve", "--admin-token-file", "t"], "--admin-token-file needs --admin-port N"),
        (["serve", "--kv-bit", "4"], "--kv-bit abbreviates --kv-bits"),
        (["match", "--messages", "notjson"], "--messages: not valid JSON"),
    ],
)
def test_usage_errors_exit_2(tiny_model: Path, capsys, extra, said) -> None:
    command, *rest = extra
    assert main([command, "--model", str(tiny_model), *rest]) == 2
    assert said in capsys.readouterr().err


def test_unknown_server_for_server_env_exits_2(tmp_path: Path, capsys) -> None:
    assert main(["server-env", "vlm-mlx", str(tmp_path / "venv")]) == 2
    assert "did you mean 'vllm-mlx'?" in capsys.readouterr().err


def test_a_request_file_that_is_not_json_is_bad_input_not_usage(tiny_model, tmp_path, capsys):
    body = tmp_path / "request.json"
    body.write_text("{", encoding="utf-8")
    assert main(["match", "--model", str(tiny_model), "--prompt-file", str(body)]) == 1
    assert f"--prompt-file {body}: not valid JSON" in capsys.readouterr().err


def test_a_mistyped_command_names_the_nearest(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["biuld"])
    assert stop.value.code == 2
    assert "unknown command 'biuld'; did you mean 'build'?" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["version"], ["-V"], ["--version"]])
def test_version_spelled_any_way(argv, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 0
    assert "(bundle format" in capsys.readouterr().out


def test_help_word_prints_help(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["help", "build"])
    assert stop.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_new_starts_a_project_in_an_empty_folder(tmp_path: Path, tiny_model: Path, capsys):
    prefixes = tmp_path / "fresh" / "prefixes"
    argv = ["--prefixes", str(prefixes), "new", "first", "--model", str(tiny_model)]
    assert main(argv) == 0
    assert (prefixes / "first.toml").is_file()
    out = capsys.readouterr().out
    assert f"build it with 'prefix-bundles build first --prefixes {prefixes}'" in out


def test_new_under_a_file_is_one_line(tmp_path: Path, tiny_model: Path, capsys) -> None:
    (tmp_path / "afile").write_text("x")
    where = tmp_path / "afile" / "prefixes"
    assert main(["--prefixes", str(where), "new", "first", "--model", str(tiny_model)]) == 1
    assert capsys.readouterr().err == f"error: cannot write in {where}: Not a directory\n"


@pytest.mark.parametrize(
    ("argv0", "hint"),
    [
        ("build.py", "python build.py build first"),
        ("/src/checkout/build.py", "python /src/checkout/build.py build first"),
        ("/usr/local/bin/prefix-bundles", "prefix-bundles build first"),
    ],
)
def test_hints_name_the_command_as_invoked(tmp_path, tiny_model, capsys, monkeypatch, argv0, hint):
    monkeypatch.setattr(sys, "argv", [argv0])
    prefixes = tmp_path / "prefixes"
    assert main(["--prefixes", str(prefixes), "new", "first", "--model", str(tiny_model)]) == 0
    out = capsys.readouterr().out
    assert f"build it with '{hint} --prefixes {prefixes}'" in out
    # a folder named prefix-bundles (next to a model) is never rewritten as the command
    assert "python" not in out.split("build it with")[0]


def test_only_the_command_is_renamed(monkeypatch) -> None:
    from pipeline.cli.common import invoked_as

    monkeypatch.setattr(sys, "argv", ["build.py"])
    said = (
        "sign it ('prefix-bundles sign b --key K', or minisign -S -t 'prefix-bundles shop@2 "
        "tiny-c01d20cbb3fb'); bundles go to /m/prefix-bundles serve reads them"
    )
    assert invoked_as(said) == said.replace("'prefix-bundles sign", "'python build.py sign")


def test_a_quantized_build_says_each_phase_and_the_whole_time(
    tmp_path: Path, tiny_model: Path, capsys
) -> None:
    from conftest import write_definition

    write_definition(tmp_path, tiny_model, kv_bits=8, kv_group_size=32)
    root = ["--prefixes", str(tmp_path / "prefixes"), "--bundles", str(tmp_path / "bundles")]
    assert main([*root, "build", "shop"]) == 0
    captured = capsys.readouterr()
    steps = [line.split(": ", 1)[1].split(" ")[0] for line in captured.err.splitlines()]
    # the prefill's lines, then the fidelity check and the self-check as each starts
    assert steps[-2:] == ["fidelity", "self-check"], captured.err
    assert "fidelity check (warm vs cold, 8 tokens), " in captured.err
    result = captured.out.splitlines()[0]
    assert ", built in " in result and "(prefill " in result and "fidelity check " in result


def test_match_fails_as_a_gate_when_only_the_template_opening_is_shared(
    shop_bundle: Path, tiny_model: Path, capsys
) -> None:
    """A full-precision bundle and a request sharing its template's first tokens: serve would
    reuse a few tokens, which is no warm start; --min-share states the bar and moves it."""
    import json

    argv = ["--bundles", str(shop_bundle.parents[2]), "match", "--model", str(tiny_model)]
    hello = ["--messages", '[{"role": "user", "content": "hello"}]']
    assert main([*argv, *hello]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("fails: ") and "below --min-share 50%" in last
    assert main([*argv, *hello, "--min-share", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("ok: ")
    assert main([*argv, *hello, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is False and 0 < report["share"] < 0.5 and report["min_share"] == 0.5


@pytest.mark.parametrize("bad", ["abc", "150", "-5"])
def test_min_share_out_of_range_is_usage(tiny_model: Path, capsys, bad) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["match", "--model", str(tiny_model), "--messages", "[]", "--min-share", bad])
    assert stop.value.code == 2
    assert "is not a share" in capsys.readouterr().err


def test_match_states_a_tie_as_a_tie(tmp_path: Path, tiny_model: Path, capsys) -> None:
    """Two bundles of the same tokens serve a request equally: said as a tie and the rule that
    breaks it (the old line said 'serves 25, shop@1 more' of two equal counts)."""
    from conftest import build_bundle, write_definition

    for name in ("shop", "twin"):
        write_definition(tmp_path, tiny_model, name)
        build_bundle(tmp_path, name)
    argv = ["--bundles", str(tmp_path / "bundles"), "match", "--model", str(tiny_model)]
    assert (
        main([*argv, "--min-share", "0", "--messages", '[{"role": "user", "content": "hi"}]']) == 0
    )
    rows = capsys.readouterr().out.splitlines()
    loser = next(line for line in rows if line.startswith("  ") and "@1" in line)
    winner = next(line for line in rows if line.startswith("* ")).split()[1]
    assert (
        f"ties at {rows[1].split()[2]} tokens with {winner}; serve takes the first mounted" in loser
    )
