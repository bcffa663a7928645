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


def test_build_then_verify_and_match_read_builds_folder(
    tmp_path: Path, shop_bundle: Path, tiny_model: Path, capsys, monkeypatch
) -> None:
    """Right after `build` (./bundles), the readers find the bundles without --bundles when the
    model has no prefix-bundles folder, and say where they read; a deployed folder wins."""
    import shutil

    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    shutil.copytree(shop_bundle, tmp_path / "bundles/shop/1" / shop_bundle.name)
    assert main(["verify", "--model", str(model)]) == 0
    err = capsys.readouterr().err
    assert (
        f"note: no {model}/prefix-bundles: reading bundles/, where build wrote bundles for this model"
        in err
    )
    messages = '[{"role": "user", "content": "hi"}]'
    assert main(["match", "--model", str(model), "--messages", messages, "--min-share", "0"]) == 0
    assert "* shop@1" in capsys.readouterr().out
    (model / "prefix-bundles").mkdir()  # a deploy's folder, even empty, is where serve reads
    assert main(["verify", "--model", str(model)]) == 1
    assert f"no bundle in {model}/prefix-bundles" in capsys.readouterr().err


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_verify_given_a_folder_of_bundles_verifies_the_bundles_in_it(
    tmp_path: Path, shop_bundle: Path, tiny_model: Path, capsys, depth
) -> None:
    import shutil

    bundle = tmp_path / "bundles/shop/1" / shop_bundle.name
    shutil.copytree(shop_bundle, bundle)
    given = [tmp_path / "bundles", tmp_path / "bundles/shop", tmp_path / "bundles/shop/1"][depth]
    assert main(["verify", "--model", str(tiny_model), str(given)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"ok {bundle} (shop@1, ")
    assert f"note: {given}: a folder of bundles; verifying the 1 bundle(s) under it" in captured.err
    assert "remove it" not in captured.err


def test_verify_given_a_folder_with_no_bundle_says_so(tmp_path: Path, tiny_model: Path, capsys):
    (tmp_path / "empty" / "x").mkdir(parents=True)
    assert main(["verify", "--model", str(tiny_model), str(tmp_path / "empty")]) == 1
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'empty'}: not a bundle folder (no manifest.json) and no bundle under "
        "it; pass bundle folders (bundles/NAME/VERSION/MODEL-FINGERPRINT) or --bundles DIR\n"
    )


def test_the_first_bundle_mounted_is_not_charged_the_imports(shop_bundle: Path, tiny_model):
    """A fresh process: the ~1 s of mlx-lm imports a load needs is paid up front and reported as
    such ("2.1 MiB in 803 ms" beside "21.6 MiB in 32 ms" read as a slow bundle)."""
    import json
    import subprocess

    code = (
        "import json, sys\n"
        "from pipeline.runtime import mount\n"
        "r = mount(sys.argv[1], sys.argv[2])\n"
        "print(json.dumps([r.import_seconds, r.bundles[0].seconds, r.seconds]))\n"
    )
    args = [sys.executable, "-c", code, str(tiny_model), str(shop_bundle)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    imports, first, total = json.loads(proc.stdout)
    assert first < imports and imports + first <= total


def test_a_bad_build_model_is_one_error_line(tmp_path: Path, tiny_model: Path, capsys) -> None:
    """`build --model nosuch` with two definitions: one line naming the folder (it was one per
    definition, then '2 of 2 failed; the others were built' when none were)."""
    from conftest import write_definition

    for name in ("shop", "other"):
        write_definition(tmp_path, tiny_model, name)
    root = ["--prefixes", str(tmp_path / "prefixes"), "--bundles", str(tmp_path / "bundles")]
    assert main([*root, "build", "--model", str(tmp_path / "nosuch")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: model folder {tmp_path / 'nosuch'} ")


def test_when_every_definition_fails_none_is_said_built() -> None:
    from pipeline.builder.batch import BuildFailures

    said = str(BuildFailures([("a", ValueError()), ("b", ValueError())], 2))
    assert said == "2 of 2 definitions failed (a, b); fix the errors above and build again"
    said = str(BuildFailures([("a", ValueError())], 2))
    assert "the others were built" in said


def test_a_captured_request_whose_developer_turn_the_template_drops_becomes_a_bundle(
    tmp_path: Path, tiny_model: Path, capsys
) -> None:
    """The tiny model's template (as Qwen3's) drops a developer turn: the server sends the tools
    block alone before the conversation. `new --from-request` says so and marks the turn, build
    makes that prefix, and match finds the request warm (build refused it: 'add a user turn')."""
    import json

    from conftest import TOOLS

    body = {
        "messages": [
            {"role": "developer", "content": "You are a careful support agent for ACME."},
            {"role": "user", "content": "Where is my order?"},
        ],
        "tools": TOOLS,
    }
    request = tmp_path / "request.json"
    request.write_text(json.dumps(body), encoding="utf-8")
    root = ["--prefixes", str(tmp_path / "prefixes"), "--bundles", str(tmp_path / "bundles")]
    new = ["--prefixes", str(tmp_path / "prefixes"), "new", "cap", "--model", str(tiny_model)]
    assert main([*new, "--from-request", str(request)]) == 0
    err = capsys.readouterr().err
    assert (
        "note: messages.0 (developer): the model's chat template drops it, as the server does"
        in err
    )
    toml = (tmp_path / "prefixes" / "cap.toml").read_text()
    assert "dropped_by_template = true" in toml
    assert main([*root, "build", "cap"]) == 0
    capsys.readouterr()
    bundles = ["--bundles", str(tmp_path / "bundles")]
    assert main([*bundles, "match", "--model", str(tiny_model), "--prompt-file", str(request)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("(100.0%), at least --min-share 50%")
    # the mark is checked: a turn the template renders is never hidden behind it
    toml = toml.replace('role = "developer"', 'role = "system"').replace(
        "version = 1", "version = 2"
    )
    (tmp_path / "prefixes" / "cap.toml").write_text(toml, encoding="utf-8")
    assert main([*root, "build", "cap", "--force"]) == 1
    assert "marked dropped_by_template, but the template renders the system content" in (
        capsys.readouterr().err
    )
