"""Prefix definitions: the shipped examples, exact errors for invalid files, slugs, and the CLI."""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

import pytest

from pipeline.blas import blas_status
from pipeline.builder.definition import (
    NAME_PATTERN,
    ModelSpec,
    find_definitions,
    load_definition,
    model_slug,
    slugify,
)
from pipeline.cli import main
from pipeline.format.errors import DefinitionError, PipelineError
from pipeline.format.fingerprint import model_chat_template

REPO = Path(__file__).resolve().parent.parent
PREFIXES = REPO / "prefixes"
EXAMPLES = ["docqa-handbook", "support-agent"]

# --- The shipped examples -----------------------------------------------------------------------


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_loads_with_a_stable_content_hash(name: str) -> None:
    first = load_definition(PREFIXES / f"{name}.toml", REPO)
    second = load_definition(PREFIXES / f"{name}.toml", REPO)
    assert first.name == name
    assert first.content_sha256 == second.content_sha256
    assert re.fullmatch(r"[0-9a-f]{64}", first.content_sha256)


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_hash_does_not_depend_on_where_the_repo_lives(name: str, tmp_path: Path) -> None:
    shutil.copy(PREFIXES / f"{name}.toml", tmp_path / f"{name}.toml")
    shutil.copytree(PREFIXES / name, tmp_path / name)
    moved = load_definition(tmp_path / f"{name}.toml", tmp_path)
    assert moved.content_sha256 == load_definition(PREFIXES / f"{name}.toml", REPO).content_sha256


def test_example_hash_changes_with_an_included_file(tmp_path: Path) -> None:
    shutil.copy(PREFIXES / "docqa-handbook.toml", tmp_path)
    shutil.copytree(PREFIXES / "docqa-handbook", tmp_path / "docqa-handbook")
    before = load_definition(tmp_path / "docqa-handbook.toml", tmp_path).content_sha256
    handbook = tmp_path / "docqa-handbook" / "handbook.md"
    handbook.write_text(handbook.read_text().replace("300 EUR", "350 EUR"))
    assert load_definition(tmp_path / "docqa-handbook.toml", tmp_path).content_sha256 != before


def test_support_agent_has_a_long_system_prompt_and_eight_tools() -> None:
    d = load_definition(PREFIXES / "support-agent.toml", REPO)
    assert [m["role"] for m in d.messages] == ["system"]
    assert 1500 <= len(d.messages[0]["content"].split()) <= 2500
    names = [t["function"]["name"] for t in d.tools]
    assert names == [
        "lookup_customer",
        "get_subscription",
        "list_invoices",
        "issue_refund",
        "reset_2fa",
        "search_kb",
        "create_ticket",
        "escalate_to_human",
    ]
    assert all(
        t["type"] == "function" and t["function"]["parameters"]["type"] == "object" for t in d.tools
    )
    assert d.spec.cache.kv_bits is None and d.spec.cache.prefill_step_size == 2048


def test_docqa_handbook_joins_instructions_and_handbook_in_one_quantized_prefix() -> None:
    d = load_definition(PREFIXES / "docqa-handbook.toml", REPO)
    folder = PREFIXES / "docqa-handbook"
    parts = [(folder / f).read_text(encoding="utf-8") for f in ("instructions.md", "handbook.md")]
    assert d.messages == [{"role": "system", "content": "\n\n".join(parts)}]
    assert 15_000 <= len(parts[1]) <= 18_000
    assert d.tools is None and d.spec.cache.kv_bits == 8


def test_examples_pin_the_demo_models_template(tiny_model: Path) -> None:
    template = model_chat_template(tiny_model)
    actual = hashlib.sha256(template.encode("utf-8")).hexdigest()
    for name in EXAMPLES:
        assert load_definition(PREFIXES / f"{name}.toml", REPO).spec.template.sha256 == actual


# --- Invalid definitions: one exact, one-line error each ------------------------------------------

SHA = "4178dad65deaaf238a623468953ebc89ac4aa6f8bac3a84c61d9cf061cf033bb"
HEAD = 'name = "x"\nversion = 1\n'
TEMPLATE = f'[template]\nsha256 = "{SHA}"\n'
MESSAGE = '[[prefix.messages]]\nrole = "system"\ncontent = "Be brief."\n'
MODEL = '[[models]]\npath = "models/demo-tiny"\n'
V = "; start at 1 and bump it whenever the content changes"
VALID = HEAD + TEMPLATE + MESSAGE + MODEL


def from_files(*files: str) -> str:
    """A definition whose one system message is read from `files`."""
    listed = ", ".join(f'"{f}"' for f in files)
    return (
        HEAD
        + TEMPLATE
        + f'[[prefix.messages]]\nrole = "system"\ncontent_files = [{listed}]\n'
        + MODEL
    )


def with_tools(text: str) -> tuple[str, dict[str, str]]:
    """A definition with tools_file = "x/tools.json" holding `text`."""
    definition = HEAD + TEMPLATE + '[prefix]\ntools_file = "x/tools.json"\n' + MESSAGE + MODEL
    return definition, {"x/tools.json": text}


INVALID = [
    (
        "unknown field",
        HEAD + 'colour = "red"\n' + TEMPLATE + MESSAGE + MODEL,
        {},
        "colour: unknown field; remove it or check its spelling",
    ),
    (
        "unknown field in a model",
        VALID + 'colour = "red"\n',
        {},
        "models.0.colour: unknown field; remove it or check its spelling",
    ),
    (
        "unknown nested field",
        VALID.replace("[template]\n", "[template]\npinned = true\n"),
        {},
        "template.pinned: unknown field; remove it or check its spelling",
    ),
    (
        "missing name",
        VALID.replace('name = "x"\n', ""),
        {},
        "name: required field is missing; add it",
    ),
    ("missing models", HEAD + TEMPLATE + MESSAGE, {}, "models: required field is missing; add it"),
    (
        "version 0",
        VALID.replace("version = 1", "version = 0"),
        {},
        "version: Input should be greater than or equal to 1 (got 0); start at 1 and bump it whenever the content changes",
    ),
    (
        "version not an integer",
        VALID.replace("version = 1", "version = 1.5"),
        {},
        "version: Input should be a valid integer (got 1.5); start at 1 and bump it whenever the content changes",
    ),
    (
        "version a word",
        VALID.replace("version = 1", 'version = "two"'),
        {},
        "version: Input should be a valid integer (got 'two'); start at 1 and bump it whenever the content changes",
    ),
    (
        "name not a slug",
        VALID.replace('name = "x"', 'name = "Support Bot"'),
        {},
        "name: String should match pattern '^[a-z0-9][a-z0-9._-]{0,63}$' (got 'Support Bot'); "
        "use 1-64 of a-z 0-9 . _ - starting with a letter or digit, and name the file the same",
    ),
    (
        "name not the file stem",
        VALID.replace('name = "x"', 'name = "y"'),
        {},
        "name: 'y' must equal the file name 'x'",
    ),
    (
        "content and content_files",
        VALID.replace(
            'content = "Be brief."\n', 'content = "Be brief."\ncontent_files = ["x/s.md"]\n'
        ),
        {"x/s.md": "Be brief."},
        "prefix.messages.0: give exactly one of 'content' or 'content_files'",
    ),
    (
        "neither content nor content_files",
        VALID.replace('content = "Be brief."\n', ""),
        {},
        "prefix.messages.0: give exactly one of 'content' or 'content_files'",
    ),
    (
        "unknown role",
        VALID.replace('role = "system"', 'role = "moderator"'),
        {},
        "prefix.messages.0.role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool'",
    ),
    (
        "included file missing",
        from_files("x/s.md", "x/gone.md"),
        {"x/s.md": "Be brief."},
        "prefix.messages.0.content_files: included file 'x/gone.md' does not exist; "
        "paths are relative to the definition's folder and must name regular UTF-8 text files",
    ),
    (
        "included file outside the folder",
        from_files("../secret.md"),
        {"../secret.md": "not for the prefix"},
        "prefix.messages.0.content_files: '../secret.md' is outside the definition's folder "
        "{base}; move the file under it",
    ),
    (
        "tools file not JSON",
        *with_tools("[{'type': 'function'}]"),
        "prefix.tools_file: not valid JSON "
        "(Expecting property name enclosed in double quotes: line 1 column 3 (char 2))",
    ),
    (
        "tools not a list",
        *with_tools('{"type": "function", "function": {"name": "f"}}'),
        "prefix.tools_file: must hold a non-empty JSON list of tools",
    ),
    (
        "tools list of strings",
        *with_tools('["lookup_customer"]'),
        "prefix.tools_file: tool 0: (the entry): Input should be a valid dictionary or instance "
        "of ToolSpec; write OpenAI function tools: "
        '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}',
    ),
    (
        "sha256 not 64 hex",
        VALID.replace(SHA, SHA[:63] + "G"),
        {},
        f"template.sha256: String should match pattern '^[0-9a-f]{{64}}$' (got '{SHA[:63]}G'); "
        "pin the sha256 that the build's 'sha256 mismatch' error prints",
    ),
    (
        "template source file without file",
        VALID.replace("[template]\n", '[template]\nsource = "file"\n'),
        {},
        "template: 'file' is required when source = \"file\" and only then",
    ),
    (
        "template file with source model",
        VALID.replace("[template]\n", '[template]\nfile = "chat.jinja"\n'),
        {},
        "template: 'file' is required when source = \"file\" and only then",
    ),
    (
        "hub repo without revision",
        VALID.replace('path = "models/demo-tiny"', 'repo = "Qwen/Qwen3-0.6B"'),
        {},
        "models.0: a hub 'repo' needs a pinned 'revision' (commit hash)",
    ),
    (
        "model path and repo",
        VALID + 'repo = "Qwen/Qwen3-0.6B"\nrevision = "c1899de2"\n',
        {},
        "models.0: give exactly one of 'path' or 'repo'",
    ),
    (
        "kv_bits 3",
        VALID + "[cache]\nkv_bits = 3\n",
        {},
        "cache.kv_bits: Input should be 4 or 8 (got 3); leave it out for a full-precision cache",
    ),
    (
        "TOML syntax error",
        VALID.replace('name = "x"', 'name "x"'),
        {},
        "not valid TOML (Expected '=' after a key in a key/value pair (at line 1, column 6)); "
        "fix the syntax",
    ),
    (
        "template kwargs hold a TOML date",
        VALID.replace("[template]\n", "[template]\nkwargs = { today = 1979-05-27 }\n"),
        {},
        "template.kwargs: 'today' = 1979-05-27 is a TOML date, which JSON cannot hold; quote it "
        'as a string: "1979-05-27"',
    ),
    (
        "template kwargs hold a nested TOML datetime",
        VALID.replace("[template]\n", "[template]\nkwargs = { a = [1, 1979-05-27T07:32:00Z] }\n"),
        {},
        "template.kwargs: 'a.1' = 1979-05-27 07:32:00+00:00 is a TOML datetime, which JSON cannot "
        'hold; quote it as a string: "1979-05-27 07:32:00+00:00"',
    ),
    (
        "template kwargs hold nan",
        VALID.replace("[template]\n", "[template]\nkwargs = { t = nan }\n"),
        {},
        "template.kwargs: 't' = nan is not a number JSON can hold; use a finite number or a string",
    ),
    (
        "template kwargs nested too deep",
        VALID.replace("[template]\n", "[template]\nkwargs = { t = " + "[" * 80 + "]" * 80 + " }\n"),
        {},
        "template.kwargs: 't' is nested more than 64 levels deep; flatten it",
    ),
    (
        "TOML nested past the parser's limit",
        VALID + "x = " + "[" * 3000 + "]" * 3000 + "\n",
        {},
        "not valid TOML (nested too deeply for this parser; flatten it); fix the syntax",
    ),
    (
        "tools file nested past the parser's limit",
        *with_tools("[" * 100000),
        "prefix.tools_file: not valid JSON (nested too deeply for this parser; flatten it)",
    ),
    (
        "tools file holds NaN",
        *with_tools('[{"type": "function", "function": {"name": "f", "parameters": {"x": NaN}}}]'),
        "prefix.tools_file: not valid JSON (NaN is not a JSON number)",
    ),
    (
        "TOML unterminated string",
        VALID.replace('name = "x"', 'name = "x'),
        {},
        "not valid TOML (Illegal character '\\n' (at line 1, column 10)); fix the syntax",
    ),
    (
        "a byte-order mark",
        "\ufeff" + VALID,
        {},
        "not valid TOML (it starts with a UTF-8 byte-order mark; save it without one); fix the "
        "syntax",
    ),
    (
        "a template variable the builder sets, in kwargs",
        VALID.replace(TEMPLATE, TEMPLATE + "kwargs = { add_generation_prompt = true }\n"),
        {},
        "template.kwargs: 'add_generation_prompt' is set by the builder, not by kwargs; remove it",
    ),
]


def write_definition(tmp_path: Path, text: str, files: dict[str, str]) -> Path:
    """prefixes/x.toml under tmp_path, with `files` relative to prefixes/."""
    prefixes = tmp_path / "prefixes"
    for rel, content in files.items():
        (prefixes / rel).parent.mkdir(parents=True, exist_ok=True)
        (prefixes / rel).write_text(content, encoding="utf-8")
    prefixes.mkdir(exist_ok=True)
    path = prefixes / "x.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_the_valid_base_of_the_table_loads(tmp_path: Path) -> None:
    path = write_definition(tmp_path, VALID, {})
    assert load_definition(path, tmp_path).messages == [{"role": "system", "content": "Be brief."}]


@pytest.mark.parametrize(
    ("text", "files", "expected"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID]
)
def test_invalid_definition_error(
    tmp_path: Path, text: str, files: dict[str, str], expected: str
) -> None:
    path = write_definition(tmp_path, text, files)
    with pytest.raises(DefinitionError) as caught:
        load_definition(path, tmp_path)
    message = f"{path}: " + expected.replace("{base}", str(path.parent.resolve()))
    assert str(caught.value) == message
    assert "\n" not in str(caught.value)


def test_missing_definition_file(tmp_path: Path) -> None:
    with pytest.raises(DefinitionError) as caught:
        load_definition(tmp_path / "gone.toml")
    assert str(caught.value) == (
        f"{tmp_path / 'gone.toml'}: does not exist; a definition must be a regular UTF-8 TOML file "
        f"(move anything else out of {tmp_path})"
    )


def test_a_definition_that_is_not_a_regular_file_fails_alone(tmp_path: Path) -> None:
    import os

    from pipeline.builder.batch import load_each

    good = write_definition(tmp_path, VALID, {})
    (good.parent / "a-folder.toml").mkdir()
    os.mkfifo(good.parent / "z-fifo.toml")  # opened blocking, it would hang the build
    loaded, failed = load_each(good.parent, [])
    assert [d.name for d in loaded] == ["x"]
    assert [(p.name, str(e)) for p, e in failed] == [
        (
            f"{name}.toml",
            f"{good.parent / name}.toml: is {kind}, not a regular file; a definition must be a "
            f"regular UTF-8 TOML file (move anything else out of {good.parent})",
        )
        for name, kind in (("a-folder", "a directory"), ("z-fifo", "a FIFO"))
    ]


@pytest.mark.parametrize("included", ["x", ""])
def test_included_folder_is_a_definition_error(tmp_path: Path, included: str) -> None:
    path = write_definition(tmp_path, from_files(included), {"x/s.md": "Be brief."})
    with pytest.raises(DefinitionError, match=r"prefix\.messages\.0\.content_files: "):
        load_definition(path, tmp_path)


def test_find_definitions_is_sorted_and_only_toml(tmp_path: Path) -> None:
    for name in ("b.toml", "a.toml", "notes.md"):
        (tmp_path / name).write_text("")
    assert [p.name for p in find_definitions(tmp_path)] == ["a.toml", "b.toml"]


# --- Model slugs --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "slug"),
    [
        (ModelSpec(path="models/demo-tiny"), "demo-tiny"),
        (ModelSpec(path="/srv/models/Qwen3-0.6B-4bit/"), "qwen3-0.6b-4bit"),
        (ModelSpec(path="models/demo-tiny", slug="tiny"), "tiny"),
        (
            ModelSpec(repo="Qwen/Qwen3-0.6B", revision="c1899de289a04d12100db370d81485cdf75e47ca"),
            "qwen3-0.6b-c1899de2",
        ),
        (ModelSpec(path="."), "model"),
    ],
)
def test_model_slug(spec: ModelSpec, slug: str) -> None:
    assert model_slug(spec) == slug


@pytest.mark.parametrize(
    ("text", "slug"),
    [
        ("Qwen3-0.6B", "qwen3-0.6b"),
        ("Llama 3.1 (8B) Instruct", "llama-3.1-8b-instruct"),
        ("My Model!!", "my-model"),
        ("..hidden", "hidden"),
        ("mistral_7b.v0-3", "mistral_7b.v0-3"),
        ("", "model"),
        ("  ", "model"),
        ("x" * 80, "x" * 64),
    ],
)
def test_slugify(text: str, slug: str) -> None:
    assert slugify(text) == slug


@pytest.mark.parametrize(
    "text",
    ["Qwen3-0.6B", "a" * 63 + "-b", "--x--", "_private", "über-model"],
)
def test_slugify_output_is_a_valid_slug(text: str) -> None:
    assert re.fullmatch(NAME_PATTERN, slugify(text))


# --- Through the CLI, in-process ----------------------------------------------------------------


def test_cli_build_bad_definition_prints_one_error_line(tmp_path: Path, capsys) -> None:
    path = write_definition(tmp_path, VALID + "[cache]\nkv_bits = 3\n", {})
    code = main(["--prefixes", str(path.parent), "--bundles", str(tmp_path / "bundles"), "build"])
    out, err = capsys.readouterr()
    assert code == 1
    assert out == ""
    lines = err.splitlines()
    assert lines == [
        f"error: {path}: cache.kv_bits: Input should be 4 or 8 (got 3); "
        "leave it out for a full-precision cache"
    ]
    assert not (tmp_path / "bundles" / "x").exists()


def test_cli_build_unknown_name_lists_the_known_ones(tmp_path: Path, capsys) -> None:
    prefixes = tmp_path / "prefixes"
    prefixes.mkdir()
    for name in ("beta", "alpha"):
        (prefixes / f"{name}.toml").write_text(VALID.replace('name = "x"', f'name = "{name}"'))
    code = main(
        [
            "--prefixes",
            str(prefixes),
            "--bundles",
            str(tmp_path / "bundles"),
            "build",
            "gamma",
            "alpha",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 1
    assert out == ""
    lines = [line for line in err.splitlines() if line != blas_status().notice]
    assert lines == [f"error: no definition named gamma in {prefixes}/ (have: alpha, beta)"]


def test_cli_list_reports_a_bad_definition_as_broken(tmp_path: Path, capsys) -> None:
    path = write_definition(tmp_path, VALID.replace("version = 1", "version = 0"), {})
    code = main(["--prefixes", str(path.parent), "--bundles", str(tmp_path / "bundles"), "list"])
    out, err = capsys.readouterr()
    assert (code, err) == (1, "")
    header, row = out.splitlines()
    assert header.startswith("prefix  model folder  tokens  size  status")
    assert row.split()[:5] == ["x", "-", "-", "-", "broken"]
    assert row.endswith(
        f"broken definition  {path}: version: Input should be greater than or equal to 1 (got 0){V}"
    )


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["build", "--kv-bits", "8"],
        ["verify", "bundles/x/1/m"],
        ["demo-model", "--size", "huge"],
    ],
    ids=["no command", "unknown command", "unknown option", "missing --model", "bad choice"],
)
def test_cli_bad_argv_exits_2(argv: list[str], capsys, monkeypatch) -> None:
    monkeypatch.setattr("sys.argv", ["/venv/bin/build.py"])  # the program names itself as invoked
    with pytest.raises(SystemExit) as caught:
        main(argv)
    out, err = capsys.readouterr()
    assert caught.value.code == 2
    assert out == ""
    assert err.startswith("usage: build.py")
    assert re.match(r"build\.py( [a-z-]+)?: error: ", err.splitlines()[-1])


def test_a_typo_in_a_field_or_a_prefix_name_says_what_was_meant(tmp_path: Path) -> None:
    from pipeline.builder.batch import select_definitions

    path = write_definition(
        tmp_path, VALID.replace('role = "system"', 'role = "system"\ncontnt = "x"'), {}
    )
    with pytest.raises(DefinitionError) as caught:
        load_definition(path, tmp_path)
    assert "unknown field (did you mean 'content'?)" in str(caught.value)
    with pytest.raises(PipelineError) as caught:
        select_definitions(path.parent, [path.stem + "x"])
    assert str(caught.value).endswith(f"did you mean '{path.stem}'?")
