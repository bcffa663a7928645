"""`new` writes a definition that builds; `match` says which bundle a request reuses, and why not."""

from __future__ import annotations

import importlib.util
import json
from importlib.util import find_spec
from pathlib import Path

import pytest

from pipeline.cli import main

from conftest import SYSTEM, TOOLS, claude_code_request


def test_new_writes_a_pinned_definition_that_builds(tmp_path: Path, tiny_model: Path, capsys):
    system = tmp_path / "system.md"
    system.write_text(SYSTEM)
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    prefixes = tmp_path / "prefixes"
    prefixes.mkdir()
    argv = ["--prefixes", str(prefixes), "--bundles", str(tmp_path / "bundles")]
    code = main([*argv[:2], "new", "shop", "--model", str(tiny_model), "--system-file", str(system), "--tools", str(tools)])  # fmt: skip
    out = capsys.readouterr().out
    assert (
        code == 0 and out.startswith(f"wrote {prefixes / 'shop.toml'} (") and " tokens for " in out
    )
    assert (prefixes / "shop" / "system.md").read_text() == SYSTEM
    assert main([*argv, "build", "--no-check"]) == 0
    assert "shop@1 -> tiny: " in capsys.readouterr().out


def test_new_refuses_bad_input_and_leaves_nothing(tmp_path: Path, tiny_model: Path, capsys):
    prefixes = tmp_path / "prefixes"
    prefixes.mkdir()
    tools = tmp_path / "tools.json"
    tools.write_text('[{"name": "f"}]')
    code = main(["--prefixes", str(prefixes), "new", "x", "--model", str(tiny_model), "--tools", str(tools)])  # fmt: skip
    err = capsys.readouterr().err.splitlines()
    assert code == 1 and len(err) == 1 and "OpenAI function tools" in err[0]
    assert list(prefixes.iterdir()) == []
    assert main(["--prefixes", str(prefixes), "new", "Bad Name", "--model", str(tiny_model)]) == 1
    assert main(["--prefixes", str(prefixes), "new", "ok", "--model", str(tiny_model)]) == 0
    assert main(["--prefixes", str(prefixes), "new", "ok", "--model", str(tiny_model)]) == 1
    assert "already exists" in capsys.readouterr().err


def request_file(tmp_path: Path, system: str) -> Path:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}], "tools": TOOLS}  # fmt: skip
    path = tmp_path / "request.json"
    path.write_text(json.dumps(body))
    return path


def test_match_reports_the_reuse_and_where_a_request_parts(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path, capsys
):
    bundles = ["--bundles", str(shop_bundle.parents[2])]
    same = request_file(tmp_path, SYSTEM)
    assert main([*bundles, "match", "--model", str(tiny_model), "--prompt-file", str(same)]) == 0
    count = json.loads((shop_bundle / "manifest.json").read_text())["tokens"]["count"]
    out = capsys.readouterr().out.splitlines()
    assert out[1] == (
        f"* shop@1                   {count:>6} of {count:<6} serve would use it: {count} of the "
        "request's tokens from it"
    )

    edited = request_file(tmp_path, SYSTEM.replace("bookshop", "book shop"))
    # serve would reuse the few tokens before the edit: below --min-share, so the gate fails
    assert main([*bundles, "match", "--model", str(tiny_model), "--prompt-file", str(edited)]) == 1
    out = capsys.readouterr().out
    assert "; parts at token " in out and "(character " in out and "bundle has " in out
    assert out.splitlines()[-1].startswith("fails: 25 of shop@1's ")

    bad = ["match", "--model", str(tiny_model), "--messages", "{not json"]
    assert main([*bundles, *bad]) == 2  # a usage error
    err = capsys.readouterr().err
    assert err.startswith("error: --messages: not valid JSON") and "use --prompt-file" in err


def test_match_decides_as_serve_does_and_exits_1_when_serve_runs_cold(
    tmp_path: Path, tiny_model: Path, capsys
):
    """An 8-bit bundle shares only the template's opening with a user-only request: serve's
    rule never serves lossy KV for that (the old `match` said it reused 1 token)."""
    from conftest import build_bundle, write_definition

    write_definition(tmp_path, tiny_model, "q8", kv_bits=8, kv_group_size=32)
    bundle = build_bundle(tmp_path, "q8")
    argv = ["--bundles", str(tmp_path / "bundles"), "match", "--model", str(tiny_model)]
    code = main([*argv, "--messages", '[{"role": "user", "content": "hello"}]'])
    out = capsys.readouterr().out.splitlines()
    assert code == 1
    assert "lossy KV is served only for at least" in out[1] and out[1].startswith("  q8@1 ")
    assert out[-1] == "serve would run this request cold: no bundle is reused"
    code = main([*argv, "--json", "--messages", '[{"role": "user", "content": "hello"}]'])
    from pipeline.cli.reports import MatchReport

    report = MatchReport.model_validate_json(capsys.readouterr().out)
    assert code == 1 and report.chosen is None and report.bundles[0].path == str(bundle)
    assert report.bundles[0].reused_tokens == 0 and report.bundles[0].lossy


def test_match_reads_an_anthropic_body_like_new_from_request(
    shop_bundle: Path, tiny_model: Path, tmp_path: Path, capsys
):
    from conftest import claude_code_request

    body = tmp_path / "anthropic.json"
    body.write_text(json.dumps(claude_code_request(str(tiny_model))))
    argv = ["--bundles", str(shop_bundle.parents[2]), "match", "--model", str(tiny_model)]
    code = main([*argv, "--prompt-file", str(body), "--server", "mlx-lm"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1
    assert err[0].startswith(
        "error: --server mlx-lm: an Anthropic messages body is checked through"
    )
    code = main([*argv, "--prompt-file", str(body)])  # auto: vllm-mlx's /v1/messages route
    err = capsys.readouterr().err.strip().splitlines()
    if importlib.util.find_spec("vllm_mlx") is None:  # not in the main environment
        assert code == 1 and len(err) == 1 and "vllm-mlx is not installed" in err[0]
    else:
        assert code in (0, 1) and not err


def test_new_from_an_anthropic_request_keeps_its_blocks_and_tools(
    tmp_path: Path, tiny_model: Path, capsys
):
    from pipeline.builder.definition import load_definition

    request = claude_code_request(str(tiny_model))
    body = tmp_path / "request.json"
    body.write_text(json.dumps(request))
    prefixes = tmp_path / "prefixes"
    prefixes.mkdir()
    code = main(["--prefixes", str(prefixes), "new", "cc", "--model", str(tiny_model), "--from-request", str(body)])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0 and "vllm-mlx's own request code" in out, err
    assert "note: system.0 is a per-request x-anthropic-billing-header: line: left out" in err
    assert "error:" not in err  # a note, not a failure
    if find_spec("vllm_mlx") is None:  # `new` says this environment cannot build it
        assert "warning: this environment cannot build it yet: " in err
        assert "vllm-mlx is not installed" in err
    d = load_definition(prefixes / "cc.toml", tmp_path)
    assert d.spec.api == "anthropic" and d.spec.servers == ["vllm-mlx"]
    assert [m["content"] for m in d.messages] == [b["text"] for b in request["system"][1:]]
    assert [t["function"]["parameters"] for t in d.tools] == [
        t["input_schema"] for t in request["tools"]
    ]
    # the build asks vllm-mlx's own code, which this environment may not have: one line if not
    import importlib.util

    if importlib.util.find_spec("vllm_mlx") is None:
        argv = ["--prefixes", str(prefixes), "--bundles", str(tmp_path / "b"), "build", "cc"]
        assert main(argv) == 1
        assert "vllm-mlx is not installed in this Python environment" in capsys.readouterr().err


def test_new_from_an_openai_request_takes_the_leading_system_part(
    tmp_path: Path, tiny_model: Path, capsys
):
    from pipeline.builder.definition import load_definition

    request = {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Where is my order 12345?"},
        ],
        "tools": TOOLS,
    }
    body = tmp_path / "request.json"
    body.write_text(json.dumps(request))
    prefixes = tmp_path / "prefixes"
    prefixes.mkdir()
    argv = ["--prefixes", str(prefixes), "--bundles", str(tmp_path / "b")]
    assert (
        main([*argv[:2], "new", "shop", "--model", str(tiny_model), "--from-request", str(body)])
        == 0
    )
    d = load_definition(prefixes / "shop.toml", tmp_path)
    assert d.spec.api == "openai" and d.spec.servers == []
    assert d.messages == request["messages"][:1] and d.tools == TOOLS
    assert main([*argv, "build", "--no-check"]) == 0  # the builder's own rendering
    assert main([*argv[:2], "new", "two", "--model", str(tiny_model), "--from-request", str(body), "--prefix-messages", "1"]) == 0  # fmt: skip
    assert load_definition(prefixes / "two.toml", tmp_path).messages == request["messages"]


def test_new_from_request_refuses_bad_requests_with_one_line(
    tmp_path: Path, tiny_model: Path, capsys
):
    prefixes = tmp_path / "prefixes"
    prefixes.mkdir()
    cases = {
        "not json": "{",
        "no system part": json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        "a server tool": json.dumps(
            {"system": "s", "messages": [], "tools": [{"type": "web_search_20250305", "name": "w"}]}
        ),
        "image content": json.dumps(
            {"messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {}}]}]}
        ),
        "a list": "[1, 2]",
    }
    for case, text in cases.items():
        body = tmp_path / "request.json"
        body.write_text(text)
        code = main(["--prefixes", str(prefixes), "new", "x", "--model", str(tiny_model), "--from-request", str(body)])  # fmt: skip
        err = capsys.readouterr().err.splitlines()
        assert code == 1 and len(err) == 1 and err[0].startswith("error: --from-request"), (
            case,
            err,
        )
        assert list(prefixes.iterdir()) == [], case


ODD_REQUESTS = [
    (
        "nested 100,000 deep",
        "[" * 100000,
        "not valid JSON (nested too deeply for this parser; flatten it)",
    ),
    (
        "anthropic without messages",
        json.dumps({"system": "You are helpful."}),
        "give a request body, an object with a 'messages' list (OpenAI chat completions or "
        "Anthropic messages)",
    ),
    (
        "openai tools not a list",
        json.dumps({"messages": [{"role": "system", "content": "hi"}], "tools": 5}),
        "tools: 5 is not a list of tools",
    ),
    (
        "anthropic tools not a list",
        json.dumps({"system": "x", "messages": [], "tools": {"name": "f"}}),
        'tools: {"name": "f"} is not a list of tools',
    ),
    (
        "anthropic system a number",
        json.dumps({"system": 5, "messages": []}),
        "system: 5 is neither a string nor a list of text blocks",
    ),
    (
        "an empty system message",
        json.dumps({"messages": [{"role": "system", "content": ""}]}),
        "the definition made from it would be refused ({prefixes}/x.toml: prefix.messages.0: "
        "content is empty; write the message text or remove the message)",
    ),
    (
        "a lone surrogate in the system text",
        '{"messages": [{"role": "system", "content": "a\\ud800b"}]}',
        "prefix message 0 has text that is not Unicode (a lone surrogate such as \\ud800); fix "
        "the request",
    ),
]


@pytest.mark.parametrize(
    ("text", "expected"), [c[1:] for c in ODD_REQUESTS], ids=[c[0] for c in ODD_REQUESTS]
)
def test_new_from_an_odd_request_body_is_one_exact_line(
    tmp_path: Path, tiny_model: Path, capsys, text: str, expected: str
):
    prefixes = tmp_path / "prefixes"
    prefixes.mkdir()
    body = tmp_path / "request.json"
    body.write_text(text)
    code = main(["--prefixes", str(prefixes), "new", "x", "--model", str(tiny_model), "--from-request", str(body)])  # fmt: skip
    assert code == 1
    expected = expected.replace("{prefixes}", str(prefixes))
    assert capsys.readouterr().err.splitlines() == [f"error: --from-request {body}: {expected}"]
    assert list(prefixes.iterdir()) == []


def test_new_writes_a_model_path_outside_the_bmp_as_valid_toml(
    tmp_path: Path, tiny_model: Path, capsys
):
    import shutil

    from pipeline.builder.definition import load_definition

    model = tmp_path / "models" / 'llama-🦙 "q" \\ \t'
    shutil.copytree(tiny_model, model)
    prefixes = tmp_path / "prefixes"
    prefixes.mkdir()
    assert main(["--prefixes", str(prefixes), "new", "shop", "--model", str(model)]) == 0
    written = (prefixes / "shop.toml").read_text(encoding="utf-8")
    assert 'path = "models/llama-🦙 \\"q\\" \\\\ \\t"' in written
    assert load_definition(prefixes / "shop.toml").spec.models[0].path == str(
        model.relative_to(tmp_path)
    )


@pytest.mark.parametrize(
    "text", ["🦙", 'a"b\\c', "".join(map(chr, range(0x20))) + "\x7f", "é\u2028"]
)
def test_toml_string_round_trips(text: str):
    from pipeline.builder.plain_data import parse_toml, toml_string

    assert parse_toml(f"x = {toml_string(text)}") == {"x": text}


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under root with its bytes (None for folders): to prove nothing changed."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() and not p.is_symlink() else None)
        for p in sorted(root.rglob("*"))
    }


HOSTILE_ROLES = [
    "../../README",
    "/etc/passwd",
    "a/b",
    "..",
    "sys\x00tem",
    "x" * 5000,
    "ѕystem",  # Cyrillic dze: looks like "system"
    "system ",
    "SYSTEM",
    None,
    42,
]


@pytest.mark.parametrize("role", HOSTILE_ROLES, ids=[repr(r)[:20] for r in HOSTILE_ROLES])
@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_new_from_request_never_writes_a_path_from_a_role(
    tmp_path: Path, tiny_model: Path, capsys, role, api: str
):
    """A role is checked against the fixed set before anything is written: one error line, and
    the whole project tree (README.md beside prefixes/ included) as it was."""
    project = tmp_path / "project"
    prefixes = project / "prefixes"
    prefixes.mkdir(parents=True)
    (project / "README.md").write_text("the project's own readme\n")
    messages = [{"role": role, "content": "overwritten?"}]
    if api == "anthropic":
        request = {"system": "You help.", "messages": messages, "max_tokens": 8}
    else:
        request = {"messages": [{"role": "system", "content": "You help."}, *messages]}
    body = tmp_path / "request.json"
    body.write_text(json.dumps(request))
    before = _tree(project)
    argv = ["--prefixes", str(prefixes), "new", "x", "--model", str(tiny_model)]
    code = main([*argv, "--from-request", str(body), "--prefix-messages", "1"])
    err = capsys.readouterr().err.splitlines()
    assert code == 1 and len(err) == 1, err
    assert (
        err[0].startswith("error: --from-request") and "is not one of system, developer" in err[0]
    )
    assert _tree(project) == before


@pytest.mark.parametrize(
    "name", ["../x", "/abs", "a/b", "x\x00", "é", "x" * 65, ".hidden", "A", ""]
)
def test_new_refuses_a_definition_name_that_is_not_a_plain_name(
    tmp_path: Path, tiny_model: Path, capsys, name: str
):
    prefixes = tmp_path / "prefixes"
    prefixes.mkdir()
    code = main(["--prefixes", str(prefixes), "new", name, "--model", str(tiny_model)])
    err = capsys.readouterr().err.splitlines()
    assert code != 0 and len(err) == 1 and err[0].startswith("error: "), err
    assert _tree(tmp_path) == {"prefixes": None}


def test_new_names_what_exists_of_the_definition(tmp_path: Path, tiny_model: Path, capsys):
    """Only the folder its files would go to exists: the error names that folder (before: it
    said prefixes/foo.toml already exists, a file that did not)."""
    prefixes = tmp_path / "prefixes"
    (prefixes / "foo").mkdir(parents=True)
    capsys.readouterr()
    assert main(["--prefixes", str(prefixes), "new", "foo", "--model", str(tiny_model)]) == 1
    assert capsys.readouterr().err == (
        f"error: folder {prefixes / 'foo'}: already exists; choose another name, or edit the "
        "definition and bump its version\n"
    )


def test_new_never_writes_through_a_dangling_link(tmp_path: Path, tiny_model: Path, capsys):
    prefixes = tmp_path / "prefixes"
    prefixes.mkdir()
    (prefixes / "x.toml").symlink_to(tmp_path / "elsewhere.toml")
    code = main(["--prefixes", str(prefixes), "new", "x", "--model", str(tiny_model)])
    err = capsys.readouterr().err.splitlines()
    assert code == 1 and "already exists" in err[0]
    assert not (tmp_path / "elsewhere.toml").exists()


def test_a_failed_new_leaves_the_tree_as_it_was(tmp_path: Path, tiny_model: Path, capsys):
    """A request whose tools fail the definition schema after the files were staged."""
    prefixes = tmp_path / "prefixes"
    prefixes.mkdir()
    request = {
        "messages": [{"role": "system", "content": "You help."}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}],
    }
    body = tmp_path / "request.json"
    body.write_text(json.dumps(request))
    before = _tree(prefixes)
    code = main(["--prefixes", str(prefixes), "new", "x", "--model", str(tiny_model), "--from-request", str(body)])  # fmt: skip
    err = capsys.readouterr().err.splitlines()
    assert code == 1 and len(err) == 1 and str(prefixes / "x.toml") in err[0], err
    assert ".new-" not in err[0]
    assert _tree(prefixes) == before


def test_a_definition_build_would_refuse_is_said_so_by_new(
    tmp_path: Path, tiny_model: Path, capsys
):
    """new asks the builder's own checks before any prefill: a definition whose turn the
    template drops says why build will refuse it, in the text and in --json's buildable
    (before: "build it with ..." and buildable null, then build refused it)."""
    from pipeline.cli.reports import NewReport

    from conftest import document

    prefixes = tmp_path / "prefixes"
    prefixes.mkdir()
    body = tmp_path / "request.json"
    body.write_text(json.dumps({"messages": [{"role": "system", "content": "x"}]}))
    argv = ["--prefixes", str(prefixes), "new", "tiny", "--model", str(tiny_model)]
    assert main([*argv, "--from-request", str(body), "--json"]) == 0
    captured = capsys.readouterr()
    doc = document(NewReport, captured.out)
    assert doc.buildable is not None and "stable" in doc.buildable, doc.buildable
    assert f"warning: build would refuse it as it is: {doc.buildable}" in captured.err
    assert main(["--prefixes", str(prefixes), "build", "tiny"]) == 1
    assert doc.buildable in capsys.readouterr().err


def test_a_developer_message_is_kept_as_captured(tmp_path: Path, tiny_model: Path):
    """OpenAI's developer role stays developer: the definition renders what mlx_lm.server (the
    default server) hands its template for that request, not a system prompt it never sends."""
    from pipeline.builder.definition import load_definition

    request = {
        "messages": [
            {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": "Where is my order 12345?"},
        ]
    }
    body = tmp_path / "request.json"
    body.write_text(json.dumps(request))
    prefixes = tmp_path / "prefixes"
    prefixes.mkdir()
    argv = ["--prefixes", str(prefixes), "new", "dev", "--model", str(tiny_model)]
    assert main([*argv, "--from-request", str(body)]) == 0
    d = load_definition(prefixes / "dev.toml", tmp_path)
    assert d.messages == request["messages"][:1]
    assert (prefixes / "dev" / "developer.md").read_text() == "Answer in French."


def test_new_json_is_one_document_with_its_schema(tmp_path: Path, tiny_model: Path, capsys):
    from pipeline.cli.reports import NewReport

    from conftest import document

    prefixes = tmp_path / "prefixes"
    prefixes.mkdir()
    argv = ["--prefixes", str(prefixes), "new", "shop", "--model", str(tiny_model), "--json"]
    assert main(argv) == 0
    doc = document(NewReport, capsys.readouterr().out)
    assert (doc.name, doc.path, doc.api, doc.servers) == (
        "shop",
        str(prefixes / "shop.toml"),
        "openai",
        [],
    )
    assert doc.tokens > 0 and doc.buildable is None and doc.notes == []


def test_a_server_without_request_code_is_a_usage_error_and_a_build_error(
    tmp_path: Path, tiny_model: Path, capsys
):
    """rapid-mlx renders requests inline in its route: `match --server` and `new --server` refuse
    it before any work (exit 2, nothing written), and a definition naming it does not build."""
    prefixes, body = tmp_path / "prefixes", request_file(tmp_path, SYSTEM)
    prefixes.mkdir()
    bundles = ["--bundles", str(tmp_path / "b")]
    model = ["--model", str(tiny_model)]
    for argv in (
        [*bundles, "match", *model, "--prompt-file", str(body)],
        ["new", "x", *model, "--from-request", str(body)],
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["--prefixes", str(prefixes), *argv, "--server", "rapid-mlx"])
        assert exit_.value.code == 2
        assert "its request code runs only inside its app" in capsys.readouterr().err
    assert list(prefixes.iterdir()) == []
    argv = ["--prefixes", str(prefixes)]
    assert main([*argv, "new", "x", *model, "--from-request", str(body)]) == 0
    definition = prefixes / "x.toml"
    text = definition.read_text().replace(
        "version = 1\n", 'version = 1\nservers = ["rapid-mlx"]\n', 1
    )
    definition.write_text(text)
    capsys.readouterr()
    assert main([*argv, *bundles, "build", "x", "--no-check"]) == 1
    err = capsys.readouterr().err
    assert "rapid-mlx's request code runs only inside its app" in err and len(err.splitlines()) == 1


def test_is_anthropic_reads_a_body_whose_tools_are_not_a_list():
    from pipeline.runtime.servers.tokens import is_anthropic

    assert is_anthropic({"messages": [], "tools": 5}) is False
    assert is_anthropic({"system": "s", "messages": [], "tools": 5}) is True
    assert is_anthropic({"messages": [], "tools": [{"name": "f", "input_schema": {}}]}) is True
