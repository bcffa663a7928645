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
    assert f"  tokens:    {count:,} (all stable), ids sha256 " in out
    assert "  fidelity:  max |logit diff| 0 <= 0, greedy match True\n" in out
    assert "You are the support assistant of a small bookshop" in out
    assert "  ok   chat template         " in out and "FAIL" not in out
    assert out.endswith(
        f"valid for {tiny_model}: yes\n"
        f"next: serve it: prefix-bundles serve --model {tiny_model} --bundles "
        f"{shop_bundle.parents[2]}\n"
    )


def test_inspect_is_aligned_tables_and_says_what_it_did_not_check(shop_bundle: Path, capsys):
    """The whole text without --model: the manifest's summary, the files with their sizes, every
    check (identity and signature shown as not made, never as ok), the verdict's scope and the
    command to run next."""
    from pipeline.format.validate import CHECKS

    assert main(["inspect", str(shop_bundle)]) == 0
    m = json.loads((shop_bundle / MANIFEST_FILE).read_text())
    p, t, mo, c, b = m["prefix"], m["tokens"], m["model"], m["cache"], m["builder"]
    sizes = {f.name: f.stat().st_size for f in shop_bundle.iterdir()}
    kib = sizes["cache.safetensors"] / 1024
    assert 1 <= kib < 1024  # the tiny model's cache: shown in KiB
    files = [("file", "bytes", "size", "")] + [
        (name, f"{n:,}", f"{n / 1024:,.1f} KiB" if n >= 1024 else f"{n} B", "")
        for name, n in sorted(sizes.items())
    ]
    files = [
        (*f[:3], "informational, outside the checksums" if f[0] == "build-report.json" else "")
        for f in files
    ]
    w = [max(len(f[i]) for f in files) for i in range(3)]
    details = dict(CHECKS)
    expected = [
        f"bundle {shop_bundle}",
        f"  prefix:    shop@1, content sha256 {p['content_sha256'][:16]}..",
        f"  tokens:    {t['count']:,} (all stable), ids sha256 {t['ids_sha256'][:16]}..",
        f"  model:     tiny, fingerprint {mo['fingerprint'][:16]}.., tokenizer "
        f"{mo['tokenizer_fingerprint'][:16]}.., template {mo['template_sha256'][:16]}.. (model's)",
        f"  cache:     2 layers (2 x KVCache), float32, KV not quantized, chunks of 2,048, layout "
        f"{c['layout']}, {kib:,.1f} KiB",
        "  fidelity:  max |logit diff| 0 <= 0, greedy match True",
        f"  builder:   pipeline {b['pipeline']}, mlx {b['mlx']}, mlx-lm {b['mlx_lm']}, "
        f"{b['device']}, float32 compute",
        f"  text:      {m['text']['chars']:,} chars, sha256 {m['text']['sha256'][:16]}..",
        f"  preview:   {json.dumps(m['text']['preview'], ensure_ascii=False)}",
        f"  build key: {m['build_key']}",
        "  signature: none (unsigned)",
        "files:",
        *(f"  {a:<{w[0]}}  {n:>{w[1]}}  {h:<{w[2]}}  {why}".rstrip() for a, n, h, why in files),
        "checks (integrity only: no --model given):",
        "  stat check                 detail",
        *(
            {
                "signature": "  --   signature             not checked: no --trusted-key given",
                "identity": "  --   identity              not checked: no --model given (the "
                "recorded fingerprints were compared with nothing)",
            }.get(name, f"  ok   {name:<21} {detail}")
            for name, detail in CHECKS
        ),
    ]
    out = capsys.readouterr().out.splitlines()
    info = [line for line in out if line.startswith("  info ")]
    assert out == [*expected, *info, "valid (integrity only): yes", (
        f"next: compare its fingerprints with the model you serve: prefix-bundles inspect "
        f"{shop_bundle} --model DIR"
    )]  # fmt: skip
    assert [line.split()[1] for line in info] == ["stability", "fidelity", "serving", "reuse"]
    assert details["identity"] not in "\n".join(out)  # the check not made is never shown as ok


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
    assert out.endswith(
        f"valid for {tiny_model_other_weights}: no\n"
        f"next: build it for this model: prefix-bundles build shop --model {tiny_model_other_weights}\n"
    )


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
    assert capsys.readouterr().out.endswith(f" {__version__} (bundle format 5; reads 2, 3, 4, 5)\n")


def test_the_eta_counts_attention_growth_on_synthetic_chunks(monkeypatch, capsys):
    """Chunks whose cost grows with position (1e-4 s a token × (1 + end / 2,000)), a prior twice
    too high (4,096): each ETA within 20 % of the truth (2.95, 2.32, 1.49, 0.44 s), where tokens
    left at the rate so far said 1.41 s at first (-52 %)."""
    import itertools
    from types import SimpleNamespace

    import pipeline.cli.common as common

    clock = itertools.count()  # one second between calls: every line is printed
    monkeypatch.setattr(common, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    report = common.progress("shop@1 -> tiny", crossover=4096)
    report(0, 9000, 0.0, 0)
    elapsed, start = 0.0, 0
    for end in (2048, 4096, 6144, 8192, 9000):
        elapsed += 1e-4 * (end - start) * (1 + end / 2000)
        report(end, 9000, round(elapsed, 6), 0)
        start = end
    assert capsys.readouterr().err.splitlines() == [
        "shop@1 -> tiny: prefill 9000 tokens",
        "shop@1 -> tiny: prefill 2048/9000 tokens, 4,941 tok/s, ETA 2.4s",
        "shop@1 -> tiny: prefill 4096/9000 tokens, 3,943 tok/s, ETA 2.1s",
        "shop@1 -> tiny: prefill 6144/9000 tokens, 3,281 tok/s, ETA 1.4s",
        "shop@1 -> tiny: prefill 8192/9000 tokens, 2,809 tok/s, ETA 0.4s",
        "shop@1 -> tiny: prefill 9000/9000 tokens, 2,678 tok/s, ETA 0.0s",
    ]


@pytest.mark.parametrize(
    ("config", "crossover"),
    [
        # the test models' shapes (pipeline.testmodels.model.SPECS): tiny, small, bench
        ({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 128}, 146.0),
        ({"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 768}, 320.0),
        ({"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072}, 608.0),
        ({"hidden_size": 1024}, 608.0),  # sizes missing: the default
    ],
)  # fmt: skip
def test_the_eta_prior_comes_from_the_models_config(config: dict, crossover: float):
    from pipeline.cli.eta import crossover_from_config

    assert crossover_from_config(config) == crossover


def test_server_env_dry_run_prints_the_pinned_commands(tmp_path: Path, capsys):
    from pipeline.cli.server_env import PTH_FILE

    venv = tmp_path / "venv"
    assert main(["server-env", "rapid-mlx", str(venv), "--dry-run"]) == 0
    pip = f"{venv}/bin/python -m pip install -q --disable-pip-version-check"
    in_venv = sys.prefix != sys.base_prefix
    pth = f"printf '%s\\n' {sys.prefix} > {venv}/lib/python3.*/site-packages/{PTH_FILE}"
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{sys.executable} -m venv --system-site-packages {venv}"
    assert lines[1 + in_venv] == (
        f"{pip} 'mlx-lm>=0.31.3,<0.32' fastapi uvicorn 'starlette>=1.0.1' python-multipart psutil "
        "prometheus-client loguru 'openai>=2.21,<3' openai-harmony tiktoken pyyaml tomli-w rich "
        "tabulate jsonschema referencing argcomplete websockets mcp 'dill>=0.4,<0.5' "
        "'xxhash>=3.6,<4'"
    )
    assert lines[2 + in_venv] == f"{pip} --no-deps rapid-mlx==0.16.10"
    assert lines[3 + in_venv] == f"{pip} --no-deps -e {ROOT}"  # this checkout, editable
    assert len(lines) == 4 + in_venv and (not in_venv or lines[1].startswith(pth[:20]))
    assert not venv.exists()  # nothing made


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["rapid", "d"], "server-env: unknown server 'rapid'; choose from vllm-mlx, mlx-omni-server, mlx-openai-server, rapid-mlx; did you mean 'rapid-mlx'?"),
        (["mlx-lm", "d"], "server-env: unknown server 'mlx-lm'; choose from vllm-mlx, mlx-omni-server, mlx-openai-server, rapid-mlx; mlx-lm needs none: it runs in this environment"),
        (["vllm-mlx", "rapid-mlx", "d"], "server-env: vllm-mlx and rapid-mlx cannot share a virtual environment (both ship a package named vllm_mlx); make one for each"),
    ],
)  # fmt: skip
def test_server_env_refuses_what_it_cannot_make(argv: list, message: str, tmp_path: Path, capsys):
    assert main(["server-env", *argv, "--dry-run"]) == 2  # a usage error
    assert capsys.readouterr().err == f"error: {message}\n"


def test_server_env_leaves_a_folder_that_is_not_a_venv_alone(tmp_path: Path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["server-env", "vllm-mlx", str(tmp_path), "--replace"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: server-env: {tmp_path} exists and is not a virtual environment (no "
        "pyvenv.cfg); it was left as it is: name another DIR"
    )
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_inspect_of_a_damaged_bundle_names_the_check_and_the_rebuild(
    shop_bundle: Path, tmp_path: Path, capsys
):
    import shutil

    bundle = shutil.copytree(shop_bundle, tmp_path / "shop" / "1" / shop_bundle.name)
    data = bytearray((bundle / "cache.safetensors").read_bytes())
    data[-5] ^= 0x01
    (bundle / "cache.safetensors").write_bytes(data)
    assert main(["inspect", str(bundle)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-2:] == [
        "valid (integrity only): no",
        "next: rebuild it: prefix-bundles build shop --force (or copy it again from its source)",
    ]
    assert [line.split()[1] for line in out if line.startswith("  FAIL ")] == ["data"]
    assert "  --   identity              not checked: no --model given" in "\n".join(out)


def test_each_targets_eta_prior_is_read_from_its_model_folder(project: Path, tiny_model: Path):
    from pipeline.cli.build import model_folders
    from pipeline.cli.common import load_definitions
    from pipeline.cli.eta import crossover_for_model

    definitions = load_definitions(project / "prefixes", [])
    folders = model_folders(definitions, project / "prefixes", None)
    assert {k: v.resolve() for k, v in folders.items()} == {"shop@1 -> tiny": tiny_model.resolve()}
    assert crossover_for_model(folders["shop@1 -> tiny"]) == 146.0  # the tiny model's config
    other = model_folders(definitions, project / "prefixes", project / "elsewhere" / "M")
    assert other == {"shop@1 -> m": project / "elsewhere" / "M"}
    assert crossover_for_model(project / "elsewhere") == 608.0  # no config.json: the default


@pytest.mark.parametrize("names", [["shop"], ["shop", "tea"]])
def test_a_lockfile_that_cannot_be_written_is_its_own_error_not_a_second_outcome(
    project: Path, tiny_model: Path, capsys, names: list[str]
):
    """The bundles are published before prefixes.lock is updated: each target is listed once,
    as built; the lockfile's failure is one line per definition saying so and what to do; a
    rerun, once it can write, records them without building anything again."""
    from conftest import write_definition

    for name in names[1:]:
        write_definition(project, tiny_model, name)
    blocker = project / "prefixes" / ".prefixes.lock.lock"
    blocker.mkdir()  # the lockfile's own file lock cannot be taken: as a read-only folder
    rc = cli(project, "build", "--no-check", "--json")
    out, err = capsys.readouterr()
    assert rc == 1 and "Traceback" not in err, err
    report = json.loads(out)
    assert [(t["prefix"], t["status"]) for t in report["targets"]] == [(n, "built") for n in names]
    assert report["totals"] == {"built": len(names), "failed": 0, "up_to_date": 0}
    lock = project / "prefixes" / "prefixes.lock"
    lines = [
        f"error: {n}@1: its bundles are built and published, but prefixes.lock does not record "
        f"them: cannot lock {lock} for update: Is a directory; make it and its folder writable "
        "and run the build again (it finds them up to date and records them)"
        for n in names
    ]
    assert [line for line in err.splitlines() if line.startswith("error: ")][: len(names)] == lines
    assert not lock.exists()
    blocker.rmdir()
    assert cli(project, "build", "--no-check", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert {t["status"] for t in report["targets"]} == {"up-to-date"}
    assert sorted(json.loads(lock.read_text())["prefixes"]) == names
