"""`--json`: one document on stdout per command, valid against its versioned schema (strict).

The CLI runs in-process on real bundles; every document is parsed with its pydantic model in strict
mode and must dump back to exactly what was printed (no missing, extra or retyped field).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.cli.reports import (
    DOCUMENTS,
    BuildReport,
    InspectReport,
    ListReport,
    VerifyReport,
    schema_text,
)
from pipeline.format.bundle_folder import CACHE_FILE, MANIFEST_FILE

from conftest import build_bundle, document, write_definition

ROOT = Path(__file__).resolve().parents[1]


def cli(project: Path, *argv: str) -> int:
    return main(
        ["--prefixes", str(project / "prefixes"), "--bundles", str(project / "bundles"), *argv]
    )


def damaged_copy(shop_bundle: Path, tmp_path: Path) -> Path:
    bundle = shutil.copytree(shop_bundle, tmp_path / "damaged")
    data = bytearray((bundle / CACHE_FILE).read_bytes())
    data[-5] ^= 0x01
    (bundle / CACHE_FILE).write_bytes(bytes(data))
    return bundle


# --- verify ----------------------------------------------------------------------------------


def test_verify_json_reports_each_bundle_and_totals(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path, capsys
):
    damaged = damaged_copy(shop_bundle, tmp_path)
    argv = ["verify", str(shop_bundle), str(damaged), "--model", str(tiny_model), "--json"]
    assert main(argv) == 1
    out = capsys.readouterr()
    doc = document(VerifyReport, out.out)
    ok, refused = doc.bundles
    assert (ok.status, ok.path, ok.prefix, ok.version) == ("ok", str(shop_bundle), "shop", 1)
    assert ok.tokens > 50 and ok.refusal is None
    assert (refused.status, refused.refusal.check) == ("refused", "data")
    assert refused.refusal.field == CACHE_FILE and "blake3 mismatch" in refused.refusal.reason
    assert (doc.totals.ok, doc.totals.refused) == (1, 1)
    assert out.err.splitlines() == [f"error: bundle {damaged}: {refused.refusal.reason}"]


def test_verify_json_all_ok_exits_0(shop_bundle: Path, tiny_model: Path, capsys):
    assert main(["verify", "--json", str(shop_bundle), "--model", str(tiny_model)]) == 0
    doc = document(VerifyReport, capsys.readouterr().out)
    assert (doc.totals.ok, doc.totals.refused, doc.model) == (1, 0, str(tiny_model))


# --- inspect ---------------------------------------------------------------------------------


def test_inspect_json_keeps_the_manifest_and_passes_every_stage(
    shop_bundle: Path, tiny_model: Path, capsys
):
    assert main(["inspect", str(shop_bundle), "--model", str(tiny_model), "--json"]) == 0
    out = capsys.readouterr().out
    doc = document(InspectReport, out)
    manifest = json.loads((shop_bundle / MANIFEST_FILE).read_text())
    manifest["cache"].setdefault("layout", "mlx-lm-0.32")  # inspect names the default layout too
    assert {k: v for k, v in json.loads(out).items() if k in manifest} == manifest
    assert doc.validity.valid and doc.validity.refusals == []
    statuses = [c.status for c in doc.validity.checks]  # signature: skipped without a key
    assert statuses == ["ok", "ok", "skipped"] + ["ok"] * 8
    assert doc.files[CACHE_FILE] == manifest["cache"]["file_bytes"]


def test_inspect_json_lists_every_mismatching_fingerprint(
    shop_bundle: Path, tiny_model_other_weights: Path, tmp_path: Path, capsys
):
    model = shutil.copytree(tiny_model_other_weights, tmp_path / "model")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] += " "
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    assert main(["inspect", str(shop_bundle), "--model", str(model), "--json"]) == 1
    v = document(InspectReport, capsys.readouterr().out).validity
    assert not v.valid and v.for_model == str(model)
    assert [(r.field, r.check) for r in v.refusals] == [
        ("model.fingerprint", "identity"),
        ("model.template_sha256", "identity"),
    ]
    assert v.refusal == v.refusals[0] and "model weights/config mismatch" in v.refusal.reason
    states = {c.name: c.status for c in v.checks}
    assert (states["mlx-lm"], states["identity"], states["data"]) == ("ok", "failed", "not-reached")


def test_inspect_json_of_an_unreadable_manifest_says_where_it_stopped(
    shop_bundle: Path, tmp_path: Path, capsys
):
    bundle = shutil.copytree(shop_bundle, tmp_path / "b")
    (bundle / MANIFEST_FILE).write_text("[]")
    assert main(["inspect", "--json", str(bundle)]) == 1
    doc = document(InspectReport, capsys.readouterr().out)
    assert doc.prefix is None and doc.build_key is None and doc.format_version is None
    (refusal,) = doc.validity.refusals
    assert (refusal.field, refusal.check) == (MANIFEST_FILE, "checksums")
    assert "sha256 mismatch" in refusal.reason


# --- list ------------------------------------------------------------------------------------


def test_list_json_reports_ok_broken_built_missing(project: Path, tiny_model: Path, capsys):
    bundle = build_bundle(project)
    write_definition(project, tiny_model, name="other")
    (project / "prefixes" / "bad.toml").write_text('name = "bad"\nversion = "one"\n')
    (bundle.parent / "tiny-000000000000").mkdir()  # an empty folder where a bundle should be
    assert cli(project, "list", "--json") == 1
    doc = document(ListReport, capsys.readouterr().out)
    by_name = {d.name: d for d in doc.definitions}
    assert (by_name["bad"].status, by_name["bad"].bundles) == ("broken", [])
    assert "bad.toml" in by_name["bad"].error
    assert [b.status for b in by_name["other"].bundles] == ["missing"]
    shop = {b.model_folder: b for b in by_name["shop"].bundles}
    assert shop[bundle.name].status == "built" and shop[bundle.name].tokens > 50
    broken = shop["tiny-000000000000"]
    assert (broken.status, broken.refusal.check) == ("broken", "files")
    t = doc.totals
    assert (t.definitions, t.broken_definitions, t.built, t.missing, t.broken) == (3, 1, 1, 1, 1)


# --- build -----------------------------------------------------------------------------------


def test_build_json_built_then_up_to_date(project: Path, capsys):
    assert cli(project, "build", "--json", "--no-check") == 0
    out = capsys.readouterr()
    (target,) = document(BuildReport, out.out).targets
    assert (target.prefix, target.version, target.status) == ("shop", 1, "built")
    assert target.tokens > 50 and target.bytes > 0 and target.prefill_seconds > 0
    assert target.tokens_per_second > 0 and target.error is None
    assert "prefill" in out.err and f"-> {target.path}" in out.err  # progress and lines on stderr
    assert cli(project, "build", "--json") == 0
    doc = document(BuildReport, capsys.readouterr().out)
    assert [(t.status, t.path, t.prefill_seconds) for t in doc.targets] == [
        ("up-to-date", target.path, None)
    ]
    assert (doc.totals.built, doc.totals.up_to_date, doc.error, doc.shard) == (0, 1, None, None)


def test_build_json_reports_every_failure_and_builds_the_others(
    project: Path, tiny_model: Path, capsys
):
    """A definition that fails (here: content changed without a version bump) stops no other:
    `aaa` before it and `zzz`... every other definition is built, each failure is one line as it
    comes, and a summary line ends the run (exit 1); --fail-fast stops at the first."""
    for name in ("aaa", "mmm"):
        write_definition(project, tiny_model, name=name)
    build_bundle(project, "mmm")
    changed = project / "prefixes" / "mmm.toml"
    changed.write_text(changed.read_text().replace("bookshop", "book shop"))  # no version bump
    assert cli(project, "build", "--json", "--no-check") == 1
    out = capsys.readouterr()
    doc = document(BuildReport, out.out)
    states = [(t.prefix, t.status) for t in doc.targets]
    assert states == [("aaa", "built"), ("mmm", "failed"), ("shop", "built")]
    assert "content changed since version 1" in doc.error and doc.targets[1].error == doc.error
    errors = [line for line in out.err.splitlines() if line.startswith("error:")]
    assert errors[0].startswith("error: mmm@1 -> tiny: ") and doc.error in errors[0]
    assert errors[1] == (
        "error: 1 of 3 definitions failed (mmm); the others were built: fix the errors above and "
        "build again"
    )
    assert (doc.totals.built, doc.totals.failed) == (2, 1)

    assert cli(project, "build", "--json", "--no-check", "--fail-fast", "--force") == 1
    out = capsys.readouterr()
    doc = document(BuildReport, out.out)
    assert [(t.prefix, t.status) for t in doc.targets] == [("aaa", "built"), ("mmm", "failed")]
    assert [line for line in out.err.splitlines() if line.startswith("error:")] == [
        f"error: {doc.error}"
    ]


def test_a_definition_that_does_not_load_stops_no_other(project: Path, capsys):
    (project / "prefixes" / "broken.toml").write_text('name = "broken"\nversion = "one"\n')
    assert cli(project, "build", "--no-check") == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert err[0].startswith(f"error: {project / 'prefixes' / 'broken.toml'}: ")
    assert err[-1].startswith("error: 1 of 2 definitions failed (broken)")
    assert list((project / "bundles" / "shop").iterdir())  # shop was built


def test_build_json_error_before_any_target_is_still_a_document(project: Path, capsys):
    assert cli(project, "build", "nosuch", "--json") == 1
    out = capsys.readouterr()
    doc = document(BuildReport, out.out)
    assert doc.targets == [] and doc.error.startswith("no definition named nosuch")
    assert out.err == f"error: {doc.error}\n"


# --- schema ----------------------------------------------------------------------------------


def test_committed_schemas_are_what_the_command_generates(tmp_path: Path, capsys):
    assert main(["schema", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    committed = sorted(p.name for p in (ROOT / "docs" / "schemas").glob("*.json"))
    assert committed == sorted(f"{name}.json" for name in DOCUMENTS)
    for name in DOCUMENTS:
        text = (ROOT / "docs" / "schemas" / f"{name}.json").read_text()
        assert text == (tmp_path / f"{name}.json").read_text() == schema_text(name), (
            f"docs/schemas/{name}.json is stale: run 'python build.py schema --out docs/schemas'"
        )


@pytest.mark.parametrize("name", sorted(DOCUMENTS))
def test_schema_names_the_versioned_document(name: str, capsys):
    assert main(["schema", name]) == 0
    schema = json.loads(capsys.readouterr().out)
    version = {"remount": 2, "push": 2, "pull": 3}.get(name, 1)  # their fields changed
    assert schema["properties"]["schema"]["const"] == f"{name}/{version}"
    assert "schema" in schema["required"] and schema["additionalProperties"] is False


def test_inspect_without_a_model_shows_the_identity_check_as_not_made(shop_bundle: Path, capsys):
    assert main(["inspect", str(shop_bundle), "--json"]) == 0
    doc = document(InspectReport, capsys.readouterr().out)
    states = {c.name: (c.status, c.detail) for c in doc.validity.checks}
    assert states["identity"][0] == "skipped" and "pass --model DIR" in states["identity"][1]
    assert states["data"][0] == "ok"


# --- keygen, sign, demo, server-env ----------------------------------------------------------


def test_keygen_and_sign_json(shop_bundle: Path, tmp_path: Path, capsys):
    from pipeline.cli.reports import KeygenReport, SignReport

    secret = tmp_path / "k.key"
    assert main(["keygen", "--secret-key", str(secret), "-W", "--json"]) == 0
    key = document(KeygenReport, capsys.readouterr().out)
    assert (key.secret_key, key.public_key, key.encrypted) == (
        str(secret), str(tmp_path / "k.pub"), False
    )  # fmt: skip
    bundle = shutil.copytree(shop_bundle, tmp_path / "b")
    damaged = damaged_copy(shop_bundle, tmp_path)
    signed = shutil.copytree(shop_bundle, tmp_path / "signed")
    assert main(["sign", str(signed), "--key", str(secret)]) == 0
    capsys.readouterr()
    argv = ["sign", str(bundle), str(damaged), str(signed), "--key", str(secret), "--json"]
    assert main(argv) == 1
    out = capsys.readouterr()
    doc = document(SignReport, out.out)
    assert doc.key_id == key.key_id
    assert [b.status for b in doc.bundles] == ["signed", "refused", "already-signed"]
    assert doc.bundles[0].vouches_for and doc.bundles[1].error.startswith(f"bundle {damaged}: ")
    assert (doc.totals.signed, doc.totals.already_signed, doc.totals.refused) == (1, 1, 1)
    assert out.err.startswith(f"error: bundle {damaged}: ")  # the refusal's line, on stderr


def test_demo_json(project: Path, monkeypatch, capsys):
    from pipeline.cli.reports import DemoReport

    monkeypatch.chdir(project)  # demo builds prefixes/ for models/demo-tiny, generated here
    assert main(["demo", "--json"]) == 0
    doc = document(DemoReport, capsys.readouterr().out)
    (row,) = doc.bundles
    assert (doc.model, doc.bundles_dir, row.prefix, row.status) == (
        "models/demo-tiny", "bundles", "shop", "built"
    )  # fmt: skip
    assert row.tokens > 50 and row.bytes > 0 and row.prefill_seconds > 0 and row.mount_ms > 0
    assert row.build_seconds >= row.prefill_seconds  # the whole build: its phases with the prefill


def test_server_env_dry_run_json(tmp_path: Path, capsys):
    from pipeline.cli.reports import ServerEnvReport

    assert main(["server-env", "vllm-mlx", str(tmp_path / "v"), "--dry-run", "--json"]) == 0
    doc = document(ServerEnvReport, capsys.readouterr().out)
    assert (doc.status, doc.servers, doc.versions) == ("dry-run", ["vllm-mlx"], None)
    assert doc.commands[-2].endswith("--no-deps vllm-mlx==0.6.0")
    assert not (tmp_path / "v").exists()
