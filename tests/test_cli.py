"""The CLI in-process: build, inspect, list; exact output where it is stable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.format.bundle_folder import MANIFEST_FILE

ROOT = Path(__file__).resolve().parents[1]


def cli(project: Path, *argv: str) -> int:
    return main(
        ["--prefixes", str(project / "prefixes"), "--bundles", str(project / "bundles"), *argv]
    )


def test_build_then_up_to_date(project: Path, capsys):
    assert cli(project, "build", "shop") == 0
    out = capsys.readouterr()
    assert "shop@1 -> tiny: " in out.out and "fidelity max|dlogit| 0 greedy_match True" in out.out
    assert "prefill" in out.err and "tok/s" in out.err  # progress on stderr
    assert cli(project, "build") == 0
    (bundle,) = (project / "bundles/shop/1").iterdir()
    assert bundle.name.startswith("tiny-") and len(bundle.name) == len("tiny-") + 12
    assert capsys.readouterr().out == f"shop@1 -> tiny: up to date ({bundle})\n"


def test_inspect_shows_stability_fidelity_and_validity(shop_bundle: Path, tiny_model: Path, capsys):
    assert main(["inspect", str(shop_bundle), "--model", str(tiny_model)]) == 0
    out = capsys.readouterr().out
    manifest = json.loads((shop_bundle / MANIFEST_FILE).read_text())
    count = manifest["tokens"]["count"]
    assert f"rendered_tokens={count}, stable_tokens={count}" in out
    assert "max_abs_logit_diff=0.0" in out and "greedy_match=True" in out
    assert "You are the support assistant of a small bookshop" in out
    assert "  ok   chat template         " in out and "FAIL" not in out
    assert out.endswith(f"valid for {tiny_model}: yes\n")


def test_inspect_json_is_the_manifest(shop_bundle: Path, capsys):
    assert main(["inspect", "--json", str(shop_bundle)]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)
    validity = data.pop("validity")
    assert (validity["valid"], validity["for_model"], validity["refusal"]) == (True, None, None)
    assert (data.pop("schema"), data.pop("bundle")) == ("inspect/1", str(shop_bundle))
    assert set(data.pop("files")) == {p.name for p in shop_bundle.iterdir()}
    assert data.pop("parent") is None  # built from token 0: the manifest has no parent key
    assert data.pop("snapshot") is None  # a prefix bundle: no snapshot record
    assert data.pop("signature") is None  # unsigned (tests/test_signature.py signs bundles)
    manifest = json.loads((shop_bundle / MANIFEST_FILE).read_text())
    manifest["cache"].setdefault("layout", "mlx-lm-0.32")  # inspect names the default layout too
    assert data == manifest  # the manifest's fields


def test_list_shows_built_and_missing(project: Path, capsys):
    assert cli(project, "list") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["prefix", "model", "folder", "tokens", "size", "status", "path", "/", "what", "to", "do"]  # fmt: skip
    assert out[1].split()[4:] == ["missing", "build", "it:", "prefix-bundles", "build", "shop"]
    cli(project, "build")
    capsys.readouterr()
    assert cli(project, "list") == 0
    header, row = capsys.readouterr().out.splitlines()
    assert row.split()[0] == "shop@1" and row.split()[2] == "361" and row.split()[5] == "built"
    assert header.index("tokens") + len("tokens") == row.index("361") + 3  # right-aligned


def test_build_py_runs_as_a_script(project: Path):
    args = [
        sys.executable,
        str(ROOT / "build.py"),
        "--prefixes",
        str(project / "prefixes"),
        "verify",
    ]
    out = subprocess.run(args, capture_output=True, text=True)
    assert out.returncode == 2 and "required" in out.stderr


def test_inspect_explains_why_a_bundle_is_invalid(
    shop_bundle: Path, tiny_model_other_weights: Path, capsys
):
    assert main(["inspect", str(shop_bundle), "--model", str(tiny_model_other_weights)]) == 1
    out = capsys.readouterr().out
    assert "  FAIL model weights/config  model weights/config mismatch (bundle expects " in out
    assert "  ok   tokenizer             " in out and "  ok   chat template         " in out
    assert out.endswith(f"valid for {tiny_model_other_weights}: no\n")


def test_demo_builds_verifies_and_mounts_every_definition(project: Path, tiny_model: Path):
    from pipeline.builder.demo import run_demo

    rows = run_demo(project / "prefixes", project / "bundles", tiny_model)
    assert [(r["prefix"], r["status"]) for r in rows] == [("shop", "built")]
    assert rows[0]["tokens"] > 50 and rows[0]["bytes"] > 0 and rows[0]["mount_ms"] > 0
    again = run_demo(project / "prefixes", project / "bundles", tiny_model)
    assert [r["status"] for r in again] == ["up to date"]


def test_a_definition_in_a_subfolder_is_reported_not_ignored(project: Path, capsys):
    stray = project / "prefixes" / "shop" / "old.toml"
    stray.write_text('name = "old"\n')
    assert cli(project, "build", "--no-check") == 0
    assert f"warning: {stray}: definitions in subfolders are not loaded" in capsys.readouterr().err


def test_global_options_are_accepted_after_the_command(project: Path, capsys):
    argv = ["list", "--prefixes", str(project / "prefixes"), "--bundles", str(project / "bundles")]
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:5] == [
        "shop@1",
        "-",
        "-",
        "-",
        "missing",
    ]


def test_a_prefix_below_the_measured_crossover_gets_a_warning(
    tmp_path: Path, tiny_model: Path, capsys
):
    import json as _json

    from conftest import model_template_sha

    prefixes = tmp_path / "prefixes"
    prefixes.mkdir()
    (prefixes / "short.toml").write_text(
        f'name = "short"\nversion = 1\n[template]\nsha256 = "{model_template_sha(tiny_model)}"\n'
        f'[prefix]\n[[prefix.messages]]\nrole = "system"\ncontent = "Be brief."\n'
        f"[[models]]\npath = {_json.dumps(str(tiny_model))}\n"
    )
    assert (
        main(["--prefixes", str(prefixes), "--bundles", str(tmp_path / "b"), "build", "--no-check"])
        == 0
    )
    err = capsys.readouterr().err
    assert "tokens, below the measured crossover of 82 tokens" in err and "warning: " in err


def test_every_command_and_option_has_help():
    import argparse

    from pipeline.cli import setup_arg_parser

    sub = next(a for a in setup_arg_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parsers = dict(sub.choices)
    missing = [
        f"{name} {a.option_strings or a.dest}"
        for name, parser in parsers.items()
        for a in parser._actions
        if not a.help and not isinstance(a, argparse._HelpAction)
    ]
    assert missing == []
    assert {c.dest for c in sub._choices_actions} >= {
        "build",
        "verify",
        "inspect",
        "list",
        "prune",
        "serve",
        "push",
        "pull",
        "new",
        "match",
        "schema",
    }


def _commands() -> list[str]:
    import argparse

    from pipeline.cli import setup_arg_parser

    sub = next(a for a in setup_arg_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


def _exit_code(argv: list[str]) -> int:
    """main's exit code, argparse's SystemExit included; any other exception fails the test."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1


@pytest.mark.parametrize("command", _commands())
@pytest.mark.parametrize("place", ["first", "last", "help", "missing value"])
def test_every_command_with_global_options_anywhere_ends_cleanly(
    command: str, place: str, tmp_path: Path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # demo-model writes models/ here; no definitions, no bundles
    (tmp_path / "prefixes").mkdir()
    glob = ["--prefixes", "prefixes", "--bundles", "bundles"]
    argv = {
        "first": [*glob, command],
        "last": [command, *glob],
        "help": [*glob, command, "--help"],
        "missing value": [command, "--bundles"],
    }[place]
    code = _exit_code(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    if place == "help":
        assert code == 0 and out.startswith("usage: ") and f" {command} " in out.splitlines()[0]
    elif code == 2:
        assert err.startswith("usage: ") and f"{command}: error: " in err
    elif code == 1:
        assert err.splitlines()[-1].startswith("error: "), err
    else:
        assert code == 0, (code, err)


def test_the_console_script_names_itself():
    script = Path(sys.executable).with_name("prefix-bundles")
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("usage: prefix-bundles ")
    done = subprocess.run(
        [sys.executable, str(ROOT / "build.py"), "verify", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.startswith("usage: build.py verify ")


def test_verify_honours_bundles_and_a_global_option_that_does_not_apply_is_refused(
    shop_bundle: Path, tiny_model: Path, capsys
):
    """verify --bundles DIR checks the bundles there (it was ignored: the folder next to the
    model was searched); --bundles on a command that reads no bundles folder is a usage error,
    not silently dropped."""
    from pipeline.cli import main

    root = shop_bundle.parents[2]
    assert main(["verify", "--model", str(tiny_model), "--bundles", str(root)]) == 0
    assert f"ok {shop_bundle} (shop@1" in capsys.readouterr().out
    assert main(["--bundles", str(root), "verify", "--model", str(tiny_model)]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["--bundles", str(root), "keygen", "--help-not-an-option"])
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        main(["--prefixes", "p", "schema"])
    assert "--prefixes does not apply to schema; leave it out" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["schema", "--help"])
    assert "--bundles" not in capsys.readouterr().out  # help shows only what applies


def test_version_names_the_release_and_the_bundle_formats(capsys):
    from pipeline import __version__
    from pipeline.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.endswith(f" {__version__} (bundle format 3; reads 2, 3)\n")
