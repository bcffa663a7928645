"""The read-side commands decide as serve does: inspect renders every manifest verify accepts and
judges a folder by where it is, list sees a higher version serve would pick, match looks where
serve looks (outside review)."""

from __future__ import annotations

import json
import shutil
import types
import typing
from pathlib import Path

from fuzz_corpus import reseal_sums
from pydantic import BaseModel

from pipeline.cli import main
from pipeline.cli.reports import InspectReport, ListReport, MatchReport
from pipeline.format.bundle_folder import CACHE_FILE, MANIFEST_FILE
from pipeline.format.manifest import Manifest

from conftest import SYSTEM, TOOLS, document


def copy_bundle(bundle: Path, root: Path, version: int = 1) -> Path:
    """A copy of a bundle in the layout, <root>/<name>/<version>/<model folder>."""
    dest = root / bundle.parent.parent.name / str(version) / bundle.name
    shutil.copytree(bundle, dest)
    return dest


def edit(bundle: Path, fn) -> None:
    """Edit manifest.json and rewrite SHA256SUMS to match (anyone can)."""
    m = json.loads((bundle / MANIFEST_FILE).read_text())
    fn(m)
    (bundle / MANIFEST_FILE).write_text(json.dumps(m, sort_keys=True, indent=2) + "\n")
    reseal_sums(bundle)


# --- inspect renders every optional field verify lets through (finding 1) ------------------------


def _record(annotation) -> type[BaseModel] | None:
    for a in (annotation, *typing.get_args(annotation)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def optional_fields(model: type[BaseModel], data: dict, at: tuple = ()) -> list[tuple]:
    """Paths of every `X | None` field of the schema, inside the records this manifest has."""
    paths = []
    for name, info in model.model_fields.items():
        union = typing.get_origin(info.annotation) in (typing.Union, types.UnionType)
        if union and type(None) in typing.get_args(info.annotation):
            paths.append((*at, name))
        record = _record(info.annotation)
        if record is not None and isinstance(data.get(name), dict):
            paths += optional_fields(record, data[name], (*at, name))
    return paths


def set_null(path: tuple):
    def fn(m: dict) -> None:
        for key in path[:-1]:
            m = m[key]
        m[path[-1]] = None

    return fn


def test_inspect_renders_each_optional_field_left_null_as_verify_decides(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path, capsys
):
    manifest = json.loads((shop_bundle / MANIFEST_FILE).read_text())
    paths = optional_fields(Manifest, manifest)
    assert ("fidelity", "threshold") in paths and ("cache", "kv_bits") in paths
    for i, path in enumerate(paths):
        bundle = copy_bundle(shop_bundle, tmp_path / f"b{i}")
        edit(bundle, set_null(path))
        model = ["--model", str(tiny_model)]
        verdict = main(["--bundles", str(tmp_path / f"b{i}"), "verify", str(bundle), *model])
        capsys.readouterr()
        assert main(["inspect", str(bundle), *model]) == verdict, path
        out = capsys.readouterr()
        assert "None" not in out.out and "Traceback" not in out.err, path
        assert main(["inspect", str(bundle), "--json", *model]) == verdict, path
        report = document(InspectReport, capsys.readouterr().out)
        assert report.validity.valid is (verdict == 0), path


def test_inspect_says_n_a_for_a_fidelity_number_the_manifest_leaves_null(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path, capsys
):
    bundle = copy_bundle(shop_bundle, tmp_path)
    edit(bundle, set_null(("fidelity", "threshold")))
    edit(bundle, set_null(("fidelity", "max_abs_logit_diff")))
    assert main(["inspect", str(bundle), "--model", str(tiny_model)]) == 0
    out = capsys.readouterr().out
    assert "  fidelity:  max |logit diff| n/a <= n/a, greedy match True\n" in out
    assert "  info fidelity               max |logit diff| n/a <= n/a, greedy match True (" in out


# --- inspect judges a folder by where it is, as verify and serve do (finding 2) ------------------


def as_snapshot(m: dict) -> None:
    for key in ("prefix", "text", "request"):
        m.pop(key, None)
    m["kind"] = "snapshot"
    m["snapshot"] = {"server": "mlx-lm", "source": "x", "lossy": False, "rank": 0}
    m["format_version"] = 3  # a snapshot's format before depends_on (no cache.blocks: format 5's)
    m["cache"].pop("blocks", None)


def test_a_bundle_folder_whose_manifest_says_snapshot_is_refused_by_inspect_as_by_verify(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path, capsys
):
    bundle = copy_bundle(shop_bundle, tmp_path)
    edit(bundle, as_snapshot)
    model = ["--model", str(tiny_model)]
    assert main(["--bundles", str(tmp_path), "verify", str(bundle), *model]) == 1
    assert "its manifest is of kind snapshot, not prefix" in capsys.readouterr().err
    assert main(["inspect", str(bundle), *model]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"bundle {bundle}\n")
    assert "  --   signature             not checked: no --trusted-key given\n" in out
    assert "  FAIL manifest              its manifest is of kind snapshot, not prefix" in out
    assert out.endswith(
        f"valid for {tiny_model}: no\n"
        "next: fix what the failed check says above, then run this command again\n"
    )
    assert main(["inspect", str(bundle), "--json", *model]) == 1
    report = document(InspectReport, capsys.readouterr().out)
    assert not report.validity.valid and report.validity.refusal.check == "manifest"


# --- list reports what serve picks: the highest version on disk (finding 3) ----------------------


def listed(project: Path, capsys) -> tuple[int, ListReport]:
    argv = ["--prefixes", str(project / "prefixes"), "--bundles", str(project / "bundles")]
    rc = main([*argv, "list", "--json"])
    return rc, document(ListReport, capsys.readouterr().out)


def test_list_reports_a_higher_version_serve_picks_and_refuses(
    project: Path, shop_bundle: Path, capsys
):
    ours = copy_bundle(shop_bundle, project / "bundles")
    higher = copy_bundle(shop_bundle, project / "bundles", version=2)
    with open(higher / CACHE_FILE, "ab") as f:
        f.write(b"x")
    rc, report = listed(project, capsys)
    (bundle,) = report.definitions[0].bundles
    assert rc == 1 and bundle.status == "broken" and bundle.path == str(ours)
    assert report.totals.broken == 1 and report.totals.built == 0
    assert bundle.refusal.reason.startswith(
        f"serve picks shop@2 ({higher}), the highest version on disk, and refuses it ("
    )
    assert bundle.refusal.reason.endswith(
        f"it never falls back to version 1, so this model runs shop cold; remove {higher}, or "
        "give the definition a version above 2 and build it"
    )
    argv = ["--prefixes", str(project / "prefixes"), "--bundles", str(project / "bundles")]
    assert main([*argv, "list"]) == 1
    row = capsys.readouterr().out.splitlines()[1]
    assert " broken  serve picks shop@2 " in row and "build shop --force" not in row


def test_list_reports_a_higher_version_serve_mounts_instead(
    project: Path, shop_bundle: Path, capsys
):
    copy_bundle(shop_bundle, project / "bundles")
    higher = copy_bundle(shop_bundle, project / "bundles", version=2)
    edit(higher, lambda m: m["prefix"].update(version=2))  # verifies: a relabelled version
    rc, report = listed(project, capsys)
    (bundle,) = report.definitions[0].bundles
    assert rc == 1 and bundle.status == "broken" and bundle.refusal.check is None
    assert bundle.refusal.reason == (
        f"serve mounts shop@2 ({higher}) instead of version 1; remove {higher}, or give the "
        "definition a version above 2 and build it"
    )


def test_list_still_says_built_when_only_older_versions_are_beside_it(
    project: Path, shop_bundle: Path, capsys
):
    copy_bundle(shop_bundle, project / "bundles")
    (project / "prefixes" / "shop.toml").write_text(
        (project / "prefixes" / "shop.toml").read_text().replace("version = 1", "version = 2")
    )
    copy_bundle(shop_bundle, project / "bundles", version=2)
    edit(project / "bundles/shop/2" / shop_bundle.name, lambda m: m["prefix"].update(version=2))
    rc, report = listed(project, capsys)
    assert rc == 0 and [b.status for b in report.definitions[0].bundles] == ["built"]


# --- match looks where serve looks, and takes serve's --trusted-key and --lockfile (finding 4) ---


def deployed(shop_bundle: Path, tiny_model: Path, tmp_path: Path) -> Path:
    """A model folder with the shop bundle in <model>/prefix-bundles, where serve looks."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    copy_bundle(shop_bundle, model / "prefix-bundles")
    return model


def match(model: Path, *argv: str) -> list[str]:
    request = json.dumps([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}])
    body = {"messages": json.loads(request), "tools": TOOLS}
    prompt = model.parent / "request.json"
    prompt.write_text(json.dumps(body))
    return ["match", "--model", str(model), "--prompt-file", str(prompt), "--json", *argv]


def test_match_without_bundles_looks_in_the_model_folder_as_serve_does(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path, monkeypatch, capsys
):
    model = deployed(shop_bundle, tiny_model, tmp_path)
    monkeypatch.chdir(tmp_path)  # no ./bundles here
    assert main(match(model)) == 0
    report = document(MatchReport, capsys.readouterr().out)
    assert report.chosen == "shop@1"
    assert report.bundles[0].path == str(model / "prefix-bundles/shop/1" / shop_bundle.name)


def test_match_takes_serve_s_trusted_keys_and_lockfile(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path, monkeypatch, capsys
):
    model = deployed(shop_bundle, tiny_model, tmp_path)
    monkeypatch.chdir(tmp_path)
    pub = tmp_path / "k.pub"
    keygen = ["keygen", "-W", "--secret-key", str(tmp_path / "k.key"), "--public-key", str(pub)]
    assert main(keygen) == 0
    capsys.readouterr()
    assert main(match(model, "--trusted-key", str(pub))) == 1  # unsigned: serve refuses it
    report = document(MatchReport, capsys.readouterr().out)
    assert report.chosen is None and "manifest.json.minisig is missing" in report.not_considered[0]

    lock = tmp_path / "prefixes.lock"
    other = {"version": 1, "content_sha256": "0" * 64, "template_sha256": "0" * 64, "models": {}}
    lock.write_text(json.dumps({"lock_version": 1, "prefixes": {"faq": other}}))
    assert main(match(model, "--lockfile", str(lock))) == 1
    report = document(MatchReport, capsys.readouterr().out)
    bundle = model / "prefix-bundles/shop/1" / shop_bundle.name
    assert report.chosen is None
    assert report.not_considered == [f"{bundle}: prefix shop is not in the lockfile {lock}"]
