"""Parse, don't trust (issue 16, findings 5, 7-12): names, versions, discovery, requests, messages.

Each table holds the variants of one class; every command refuses with one `error:` line.
"""

from __future__ import annotations

import ast
import io
import json
import re
import shutil
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from pipeline.cli import main
from pipeline.format.lockfile import LockError, read_lock
from pipeline.format.names import is_model_folder, is_name, parse_index, parse_ref, parse_version
from pipeline.runtime import mount

from conftest import build_bundle, write_definition

ROOT = Path(__file__).resolve().parents[1]
MODEL_FOLDER = "tiny-0123456789ab"


def one_error(capsys, rc: int) -> str:
    """Exit 1, exactly one `error: ` line on stderr and no traceback; return that line."""
    err = capsys.readouterr().err
    assert rc == 1, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# --- Versions and NAME@VERSION: ASCII digits only (finding 7) -----------------------------------

VERSIONS = [
    ("1", 1),
    ("12", 12),
    ("999999999", 999_999_999),
    ("1000000000", None),  # past MAX_VERSION
    ("0", None),
    ("01", None),  # would alias version 1
    ("²", None),  # str.isdigit() is True, int() raises
    ("٣", None),  # str.isdigit() is True, int() reads 3
    ("１", None),  # fullwidth one
    ("1\n", None),
    (" 1", None),
    ("+1", None),
    ("1_0", None),  # int() reads 10
    ("1e3", None),
    ("", None),
]


@pytest.mark.parametrize(("text", "expected"), VERSIONS)
def test_parse_version_takes_canonical_ascii_digits_only(text: str, expected: int | None):
    assert parse_version(text) == expected


@given(st.text(max_size=12))
def test_parse_version_and_ref_never_raise_and_round_trip(text: str):
    version = parse_version(text)
    assert version is None or (str(version) == text and text.isascii())
    index = parse_index(text)
    assert index is None or str(index) == text
    ref = parse_ref(text)
    if ref is not None:
        name, number = ref
        assert text == (name if number is None else f"{name}@{number}")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("shop", ("shop", None)),
        ("shop@2", ("shop", 2)),
        ("shop@²", None),
        ("shop@٣", None),
        ("shop@", None),
        ("@2", None),
        ("shop@2@3", None),
        ("shop@02", None),
        ("Shop@2", None),
        ("shop\n", None),
        ("shop@2\n", None),
    ],
)
def test_parse_ref(text: str, expected):
    assert parse_ref(text) == expected


@pytest.mark.parametrize("item", ["shop@²", "shop@٣", "shop@", "shop\n", "shop@0", "Shop"])
def test_pull_prefix_refuses_what_is_not_name_or_name_at_ascii_version(
    item: str, tiny_model: Path, tmp_path: Path, capsys
):
    argv = ["pull", "--model", str(tiny_model), "--repo", "org/bundles", "--prefix", item]
    line = one_error(capsys, main(["--bundles", str(tmp_path / "b"), *argv]))
    assert line.startswith(f"error: --prefix {item!r}: pass NAME or NAME@VERSION (e.g. shop@2; ")


def test_hub_listing_ignores_folders_outside_the_layout():
    from pipeline.distribute.hub import remote_bundles

    good = f"shop/1/{MODEL_FOLDER}/manifest.json"
    bad = [f"shop/²/{MODEL_FOLDER}/m", f"shop/٣/{MODEL_FOLDER}/m", f"shop/01/{MODEL_FOLDER}/m"]
    bad += [f"shop\n/1/{MODEL_FOLDER}/m", f"shop/1/{MODEL_FOLDER}\n/m", f"Shop/1/{MODEL_FOLDER}/m"]
    assert [b.path for b in remote_bundles([good, *bad])] == [f"shop/1/{MODEL_FOLDER}"]


# --- Names: whole-text patterns, never `$` before a newline (finding 9) --------------------------


@pytest.mark.parametrize("name", ["x\n", "shop\n", "x\r", ".x", "X", "a" * 65, "x/y", "x y", ""])
def test_new_refuses_a_name_outside_the_rule_and_writes_nothing(
    name: str, tiny_model: Path, tmp_path: Path, capsys
):
    prefixes = tmp_path / "prefixes"
    rc = main(["--prefixes", str(prefixes), "new", name, "--model", str(tiny_model)])
    line = one_error(capsys, rc)
    assert line == (
        f"error: name {name!r}: use 1-64 of a-z 0-9 . _ - starting with a letter or digit"
    )
    assert not prefixes.exists() or list(prefixes.iterdir()) == []


def test_name_checks_take_the_whole_text():
    assert not is_name("x\n") and is_name("x")
    assert not is_model_folder(MODEL_FOLDER + "\n") and is_model_folder(MODEL_FOLDER)


def trailing_newline_cases() -> list:
    """Checks that must refuse a value ending in a newline (or a non-ASCII digit)."""
    from pipeline.builder.definition import ModelSpec
    from pipeline.builder.shards import Shard
    from pipeline.distribute.hub import check_repo_id
    from pipeline.format.errors import PipelineError
    from pipeline.format.manifest import ModelInfo, ParentInfo, PrefixInfo

    h = "a" * 64
    date = "2026-01-01\n"
    info = dict(slug="x", fingerprint=h, tokenizer_fingerprint=h, template_sha256=h)
    return [
        (PipelineError, lambda: check_repo_id("org/name\n")),
        (ValidationError, lambda: ModelSpec(path="m", slug="x\n")),
        (ValidationError, lambda: PrefixInfo(name="x\n", version=1, content_sha256=h)),
        (ValidationError, lambda: ModelInfo(**info, template_source="m", template_date=date)),
        (ValidationError, lambda: ModelInfo(**info, template_source="m", template_date="٢٠٢٦-01-01")),
        (ValidationError, lambda: ParentInfo(prefix="x", version=1, folder="f\n", file_sha256=h, reused_tokens=1)),
        (ValueError, lambda: Shard.parse("١/٢")),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(7))
def test_every_name_check_refuses_a_trailing_newline(case: int):
    error, check = trailing_newline_cases()[case]
    with pytest.raises(error):
        check()


def test_definition_name_with_a_newline_is_refused(tmp_path: Path, tiny_model: Path):
    from pipeline.builder.definition import load_definition
    from pipeline.format.errors import DefinitionError

    path = write_definition(tmp_path, tiny_model)
    path.write_text(path.read_text().replace('name = "shop"', 'name = "shop\\n"'))
    with pytest.raises(DefinitionError) as info:
        load_definition(path, tmp_path)
    assert "name: String should match pattern" in str(info.value)


def pattern_literals(tree: ast.AST):
    """(line, pattern) of every string literal compiled by `re` or given as pattern=."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in {
            "compile",
            "match",
            "search",
            "fullmatch",
        }:
            if isinstance(func.value, ast.Name) and func.value.id == "re" and node.args:
                if isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                    yield node.lineno, "re", node.args[0].value
        for kw in node.keywords:
            if kw.arg == "pattern" and isinstance(kw.value, ast.Constant):
                yield node.lineno, "pydantic", kw.value.value


def test_no_pattern_in_the_tree_matches_before_a_newline_or_takes_unicode_digits():
    """Python's `re`: `$` matches before a final newline and `\\d` takes any Unicode digit; pydantic
    patterns (Rust regex) end `$` at the end of the text, but `\\d` is Unicode there too."""
    bad, digit_checks = [], 0
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for line, engine, pattern in pattern_literals(tree):
            where = f"{path.relative_to(ROOT)}:{line}"
            if engine == "re" and pattern.endswith("$"):
                bad.append(f"{where}: {pattern!r} ends in $ (use \\Z)")
            if "\\d" in pattern and "__version__" not in path.read_text().splitlines()[line - 1]:
                bad.append(f"{where}: {pattern!r} uses \\d (use [0-9])")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in {
                "isdigit",
                "isdecimal",
                "isnumeric",
            }:
                bad.append(
                    f"{path.relative_to(ROOT)}:{node.lineno}: str.{node.attr}() (use names.py)"
                )
            digit_checks += isinstance(node, ast.Name) and node.id == "parse_version"
    assert bad == []
    assert digit_checks >= 5  # the one parser is what the tree uses


# --- Discovery: only <root>/<name>/<version>/<model folder> (finding 5) --------------------------

OUTSIDE = [  # (where a copy of shop@1 is put, the path reported for it)
    ("backup/shop/1/{m}", "backup/shop"),
    ("shop/01/{m}", "shop/01"),
    ("shop/²/{m}", "shop/²"),
    ("shop/٣/{m}", "shop/٣"),
    ("shop/1\n/{m}", "shop/1\n"),
    ("Shop/1/{m}", "Shop"),
    ("shop/{m}", "shop/{m}"),
    ("shop/1/{m}-copy", "shop/1/{m}-copy"),
    ("shop/1/copy-{m}x", "shop/1/copy-{m}x"),
]


@pytest.fixture(scope="module")
def shop_v1(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    root = tmp_path_factory.mktemp("v1")
    write_definition(root, tiny_model)
    (root / "bundles").mkdir()
    return build_bundle(root)


@pytest.mark.parametrize(("place", "reported"), OUTSIDE)
def test_a_bundle_outside_the_layout_is_reported_never_mounted(
    place: str, reported: str, shop_v1: Path, tiny_model: Path, tmp_path: Path
):
    bundles = tmp_path / "bundles"
    shutil.copytree(shop_v1, bundles / "shop" / "1" / shop_v1.name)
    shutil.copytree(shop_v1, bundles / place.format(m=shop_v1.name))
    result = mount(tiny_model, bundles, skip_refused=True)
    assert [b.path for b in result.bundles] == [bundles / "shop" / "1" / shop_v1.name]
    refused = {r.path: r for r in result.refused}
    problem = refused[bundles / reported.format(m=shop_v1.name)]
    assert problem.field == "layout" and "never mounted" in problem.reason

    pinned = mount(tiny_model, bundles, skip_refused=True, versions={"shop": 2})
    assert pinned.bundles == []  # the lockfile pins shop@2: nothing else may be mounted


def test_serve_lockfile_is_not_bypassed_by_a_nested_copy(
    shop_v1: Path, tiny_model: Path, tmp_path: Path, capsys
):
    """The finding: shop@1 in backup/ was mounted although the lockfile pins shop@2."""
    from pipeline.format.lockfile import LockedPrefix, Lockfile, locked_versions, write_lock

    bundles = tmp_path / "bundles"
    shutil.copytree(shop_v1, bundles / "shop" / "1" / shop_v1.name)
    shutil.copytree(shop_v1, bundles / "backup" / "shop" / "1" / shop_v1.name)
    lock = tmp_path / "prefixes.lock"
    entry = LockedPrefix(version=2, content_sha256="a" * 64, template_sha256="b" * 64, models={})
    write_lock(lock, Lockfile(prefixes={"shop": entry}))
    result = mount(tiny_model, bundles, skip_refused=True, versions=locked_versions(lock))
    assert result.bundles == [] and result.older == [bundles / "shop" / "1" / shop_v1.name]
    assert [r.path for r in result.refused] == [bundles / "backup" / "shop"]

    serve = ["serve", "--model", str(tiny_model), "--bundles", str(bundles), "--strict"]
    line = one_error(capsys, main([*serve, "--lockfile", str(lock)]))
    assert line.startswith(f"error: bundle {bundles / 'backup' / 'shop'}: 'shop' is not a version")


def test_a_lockfile_mounts_no_prefix_it_does_not_name(shop_v1: Path, tiny_model: Path, tmp_path):
    bundles = tmp_path / "bundles"
    shutil.copytree(shop_v1, bundles / "shop" / "1" / shop_v1.name)
    result = mount(tiny_model, bundles, skip_refused=True, versions={"other": 1})
    assert result.bundles == [] and [r.field for r in result.refused] == ["lockfile"]
    assert result.refused[0].reason.startswith(
        "prefix shop is not in the lockfile (it pins other@1)"
    )
    single = mount(tiny_model, bundles / "shop" / "1" / shop_v1.name, versions={"shop": 2})
    assert single.bundles == [] and single.older == [bundles / "shop" / "1" / shop_v1.name]


def test_verify_match_and_list_use_the_same_discovery(
    shop_v1: Path, tiny_model: Path, tmp_path: Path, capsys
):
    model = shutil.copytree(tiny_model, tmp_path / "model")
    deployed = model / "prefix-bundles"
    shutil.copytree(shop_v1, deployed / "shop" / "1" / shop_v1.name)
    shutil.copytree(shop_v1, deployed / "backup" / "shop" / "1" / shop_v1.name)
    nested = deployed / "backup" / "shop"

    assert main(["verify", "--model", str(model)]) == 1
    err = capsys.readouterr().err
    assert f"error: bundle {nested}: 'shop' is not a version folder" in err
    assert f"newest {deployed / 'shop' / '1' / shop_v1.name}" in err and "backup/shop/1" not in err

    messages = json.dumps([{"role": "user", "content": "hi"}])
    rc = main(["--bundles", str(deployed), "match", "--model", str(model), "--messages", messages])
    err = capsys.readouterr().err
    assert rc in (0, 1) and f"bundle {nested}: 'shop' is not a version folder" in err
    assert "(not considered)" in err and "Traceback" not in err

    write_definition(tmp_path, tiny_model)
    argv = ["--prefixes", str(tmp_path / "prefixes"), "--bundles", str(deployed), "list"]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert f"warning: bundle {nested}: 'shop' is not a version folder" in out.err
    assert out.out.count("built") == 1


@pytest.mark.parametrize("version", ["²", "٣", "01"])
def test_a_unicode_digit_version_folder_is_one_line_everywhere(
    version: str, shop_v1: Path, tiny_model: Path, tmp_path: Path, capsys
):
    """The finding: verify --model, serve and prune died with a traceback on shop/²/..."""
    model = shutil.copytree(tiny_model, tmp_path / "model")
    deployed = model / "prefix-bundles"
    shutil.copytree(shop_v1, deployed / "shop" / version / shop_v1.name)
    line = one_error(capsys, main(["verify", "--model", str(model)]))
    assert line.startswith(f"error: bundle {deployed / 'shop' / version}: {version!r} is not a")

    serve = ["serve", "--model", str(model), "--strict"]
    assert one_error(capsys, main(serve)) == line

    write_definition(tmp_path, tiny_model)
    prune = ["--prefixes", str(tmp_path / "prefixes"), "--bundles", str(deployed), "prune"]
    assert main(prune) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert (deployed / "shop" / version / shop_v1.name).is_dir()  # never deleted as if a version


# --- Requests for `match` (finding 8) -----------------------------------------------------------

CONTENT = 'give a string or a list of text parts [{"type": "text", "text": "..."}]'
BAD_MESSAGES = [
    ("[]", "messages: List should have at least 1 item after validation, not 0"),
    ('[{"role": "user"}]', f"messages.0: 'content' is missing; {CONTENT}"),
    ('[{"role": "user", "content": 5}]', f"messages.0.content: {CONTENT} (got 5; "),
    ('[{"role": "user", "content": null}]', f"messages.0: 'content' is missing; {CONTENT}"),
    ('[{"role": "user", "content": [{"type": "image_url"}]}]', f"messages.0.content: {CONTENT}"),
    ('[{"role": "user", "content": [{"text": "hi"}]}]', f"messages.0.content: {CONTENT}"),
    (
        '[{"role": "bot", "content": "x"}]',
        "messages.0.role: Input should be 'system', 'developer', 'user', ",
    ),
    ('[{"role": "user", "content": "x", "x": 1}]', "messages.0.x: unknown field; remove it"),
    ('[{"content": "x"}]', "messages.0.role: required field is missing; add it"),
    ("[5]", "messages.0: Input should be a valid dictionary"),
    ("5", "the request is 5; give {"),
    ('{"messages": "hi"}', "messages: Input should be a valid list"),
    ('{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "x"}]}', "tools.0.type"),
]


@pytest.mark.parametrize(("messages", "message"), BAD_MESSAGES)
def test_match_refuses_a_malformed_request_with_one_line(
    messages: str, message: str, shop_v1: Path, tiny_model: Path, capsys
):
    bundles = ["--bundles", str(shop_v1.parents[2])]
    rc = main([*bundles, "match", "--model", str(tiny_model), "--messages", messages])
    assert one_error(capsys, rc).startswith(f"error: --messages: {message}")


def test_match_accepts_openai_text_parts_as_the_server_joins_them(
    shop_v1: Path, tiny_model: Path, capsys
):
    bundles = ["--bundles", str(shop_v1.parents[2])]
    outputs = []
    for content in ("hello there", [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]):  # fmt: skip
        messages = json.dumps([{"role": "user", "content": content}])
        main([*bundles, "match", "--model", str(tiny_model), "--messages", messages])
        out = capsys.readouterr()
        assert "Traceback" not in out.err and out.out.startswith("request: ")
        outputs.append(out.out)
    assert outputs[0] == outputs[1]


# --- Missing folders are named as such (findings 11, 12) ----------------------------------------


def missing_model_commands(model: str, bundle: str) -> list[list[str]]:
    return [
        ["verify", "--model", model],
        ["verify", "--model", model, bundle],
        ["new", "fresh", "--model", model],
        ["match", "--model", model, "--messages", '[{"role": "user", "content": "x"}]'],
        ["inspect", bundle, "--model", model],
        ["serve", "--model", model, "--bundles", str(Path(bundle).parents[2]), "--strict"],
    ]


@pytest.mark.parametrize("command", range(6))
def test_a_missing_model_folder_is_named(command: int, shop_v1: Path, tmp_path: Path, capsys):
    missing = tmp_path / "nonexistent"
    argv = missing_model_commands(str(missing), str(shop_v1))[command]
    prefixes = ["--prefixes", str(tmp_path / "prefixes")] if argv[0] == "new" else []
    rc = main([*prefixes, *argv])
    assert one_error(capsys, rc) == (
        f"error: model folder {missing} does not exist; point --model at an MLX model folder "
        "(config.json, *.safetensors, tokenizer files)"
    )


def test_build_names_a_missing_model_folder(tmp_path: Path, tiny_model: Path, capsys):
    path = write_definition(tmp_path, tiny_model)
    argv = ["--prefixes", str(tmp_path / "prefixes"), "--bundles", str(tmp_path / "b"), "build"]
    missing = tmp_path / "nonexistent"
    assert one_error(capsys, main([*argv, "--model", str(missing)])) == (
        f"error: model folder {missing} does not exist; point --model at an MLX model folder "
        "(config.json, *.safetensors, tokenizer files)"
    )
    path.write_text(path.read_text().replace(f'path = "{tiny_model}"', f'path = "{missing}"'))
    assert one_error(capsys, main(argv)) == (
        f"error: model {missing}: folder {missing} does not exist; generate the demo model with "
        "'prefix-bundles demo-model', fix models.path or pass --model"
    )


@pytest.mark.parametrize("make", [False, True])
def test_list_refuses_a_prefixes_folder_without_definitions_like_build(
    make: bool, tmp_path: Path, capsys
):
    prefixes = tmp_path / "prefixes"
    if make:
        prefixes.mkdir()
    lines = []
    for command in ("list", "build"):
        rc = main(["--prefixes", str(prefixes), "--bundles", str(tmp_path / "b"), command])
        lines.append(one_error(capsys, rc))
    assert lines[0] == lines[1] == f"error: no prefix definitions (*.toml) in {prefixes}/"


@pytest.mark.parametrize(
    ("value", "shown"), [("2", "2"), ('"1"', "'1'"), ("true", "True"), ("1.0", "1.0"), ("0", "0")]
)
def test_a_lockfile_with_an_unknown_lock_version_is_refused(
    value: str, shown: str, tiny_model: Path, tmp_path: Path, capsys
):
    lock = tmp_path / "prefixes.lock"
    lock.write_text(f'{{"lock_version": {value}, "prefixes": {{}}}}\n')
    message = (
        f"{lock}: lock_version {shown} is not supported (this version reads lock_version 1, an "
        "integer); use the pipeline version that wrote it, or delete it and rebuild to write a new one"
    )
    with pytest.raises(LockError) as info:
        read_lock(lock)
    assert str(info.value) == message
    bundles = tmp_path / "bundles"
    bundles.mkdir()
    serve = [
        "serve",
        "--model",
        str(tiny_model),
        "--bundles",
        str(bundles),
        "--lockfile",
        str(lock),
    ]
    assert one_error(capsys, main(serve)) == f"error: {message}"


# --- Progress tells the truth (finding 10) -------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "text"),
    [
        ((0, 40, 0.0, 0), "40 tokens"),
        ((16, 40, 0.01, 0), "16/40 tokens, 1,600 tok/s, ETA 0.0s"),
        ((10240, 11078, 0.0, 10240), "838 of 11078 tokens (10,240 reused)"),
        ((10256, 11078, 0.01, 10240), "10256/11078 tokens (10,240 reused), 1,600 tok/s, ETA 0.5s"),
        ((11078, 11078, 0.0, 11078), "0 of 11078 tokens (11,078 reused)"),
    ],
)
def test_progress_counts_reused_tokens_as_reused(call: tuple, text: str):
    from pipeline.cli.common import progress_text

    assert progress_text(*call) == text


def test_the_progress_bar_shows_reused_tokens_and_the_prefill_rate():
    from rich.console import Console

    from pipeline.cli.common import _bar

    out = io.StringIO()
    stage = {"what": "prefill", "eta": None}
    report = _bar("shop@2 -> tiny", stage, Console(file=out, force_terminal=True, width=200))
    report(10240, 11078, 0.0, 10240)
    report(10256, 11078, 0.01, 10240)
    report(11078, 11078, 0.5, 10240)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    assert "838 of 11078 tokens (10,240 reused)" in text
    assert "10256/11078 tokens (10,240 reused), 1,600 tok/s" in text
    assert "tok/s" in text and "10,240,000" not in text


def test_an_incremental_build_prints_reused_tokens_and_a_prefill_rate(
    tmp_path: Path, tiny_model: Path, capsys
):
    path = write_definition(tmp_path, tiny_model, prefill_step_size=16)
    argv = ["--prefixes", str(tmp_path / "prefixes"), "--bundles", str(tmp_path / "bundles")]
    (tmp_path / "bundles").mkdir()
    assert main([*argv, "build", "--no-check"]) == 0
    path.write_text(
        path.read_text().replace("version = 1", "version = 2").replace("9-17.", "9-18.")
    )
    capsys.readouterr()
    assert main([*argv, "build", "--no-check"]) == 0
    err = capsys.readouterr().err.splitlines()
    lines = [line for line in err if line.startswith("shop@2 -> tiny: prefill ")]
    reused = int(lines[0].split("(")[1].split(" reused")[0].replace(",", ""))
    total = int(lines[0].split(" of ")[1].split(" ")[0])
    assert reused > 0 and lines[0] == (
        f"shop@2 -> tiny: prefill {total - reused} of {total} tokens ({reused:,} reused)"
    )
    rate = float(lines[1].split(", ")[1].removesuffix(" tok/s").replace(",", ""))
    assert f"({reused:,} reused), " in lines[1] and 0 < rate < 10_000_000


# --- One line, whatever the user typed -----------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["build", "shop\n"],
        ["inspect", "bundles/x\ny"],
        ["verify", "--model", "/nonexistent\n\x1b[2J"],
        ["match", "--model", "m\r", "--messages", '[{"role": "user", "content": "x"}]'],
    ],
)
def test_a_newline_in_what_the_user_typed_stays_on_the_error_line(
    argv: list[str], project: Path, capsys
):
    from pipeline.cli import USES_GLOBALS

    uses = USES_GLOBALS[argv[0]]
    glob = [f"--{o}" for o in ("prefixes", "bundles") if o in uses]
    glob = [x for o in glob for x in (o, str(project / ("prefixes" if o == "--prefixes" else "b")))]
    rc = main([*glob, *argv])
    line = one_error(capsys, rc)
    assert "\x1b" not in line and ("\\n" in line or "\\r" in line)
