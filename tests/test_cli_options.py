"""Options as the command line takes them: never abbreviated, a single-valued one at most once,
conflicting or non-applying ones refused (exit 2, one `error:` line), nothing done before."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pipeline.cli import main, setup_arg_parser
from pipeline.cli.parser import CliParser, Once
from pipeline.runtime.snapshot_store import MARK_TEXT, SET_MARK

REPEATABLE = (argparse._AppendAction, argparse._CountAction, argparse._ExtendAction)
NOT_VALUES = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def usage_error(argv: list[str], capsys) -> str:
    """The `error:` line of a usage error (exit 2), argparse's prog prefix left out."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    return last[last.index("error: ") :]


def parsers() -> dict[str, argparse.ArgumentParser]:
    """The top-level parser ('') and every command's."""
    top = setup_arg_parser()
    (sub,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    return {"": top, **sub.choices}


def single_valued(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if a.option_strings and not isinstance(a, REPEATABLE + NOT_VALUES)
    ]


def a_value(action: argparse.Action) -> list[str]:
    """The option's arguments: one its type and choices accept (none for a flag)."""
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(next(iter(action.choices)))]
    for text in ("1", "1/2", "mlx-lm", "x"):
        try:
            (action.type or str)(text)
            return [text]
        except (argparse.ArgumentTypeError, ValueError, TypeError):
            continue
    raise AssertionError(f"no value found for {action.option_strings}")


def test_every_parser_is_a_cli_parser_without_abbreviations():
    """Structural: a command added later gets both rules too (its parser is made by argparse
    from the top-level parser's class)."""
    for name, parser in parsers().items():
        assert isinstance(parser, CliParser) and parser.allow_abbrev is False, name
        for action in parser._actions:
            assert isinstance(action, REPEATABLE + NOT_VALUES + (Once,)), (
                f"{name} {action.option_strings or action.dest}: {type(action).__name__}"
            )


def test_every_single_valued_option_given_twice_is_a_usage_error(capsys):
    wrong = []
    for name, parser in parsers().items():
        for action in single_valued(parser):
            option = max(action.option_strings, key=len)
            twice = [option, *a_value(action), option, *a_value(action)]
            argv = [*twice, "build"] if name == "" else [name, *twice]
            line = usage_error(argv, capsys)
            if line != f"error: {option} given twice; pass it once":
                wrong.append((argv, line))
    assert wrong == []


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["build", "--shard", "1/2", "--shard", "2/2"], "--shard given twice; pass it once"),
        (["build", "c", "--sign-key", "k1.key", "--sign-key", "k2.key"], "--sign-key given twice; pass it once"),
        (["build", "--model", "A", "--model", "B"], "--model given twice; pass it once"),
        (["build", "--prefixes", "x", "--prefixes", "y"], "--prefixes given twice; pass it once"),
        (["--prefixes", "x", "build", "--prefixes", "y"], "--prefixes given twice; pass it once"),
        (["--bundles", "x", "--bundles", "y", "list"], "--bundles given twice; pass it once"),
        (["new", "n", "--model", "m", "--from-request", "r", "--prefix-messages", "1", "--prefix-messages", "0"], "--prefix-messages given twice; pass it once"),
        (["match", "--model", "m", "--messages", "[]", "--messages", "[1]"], "--messages given twice; pass it once"),
        (["serve", "--model", "A", "--model", "B"], "--model given twice; pass it once"),
        (["build", "--check", "--no-check"], "--check and --no-check given together; pass one of them"),
        (["build", "-v", "--verbose"], "-v and --verbose given together; pass one of them"),
        (["build", "shop", "shop"], "shop given twice; name it once"),
        (["sign", "b", "b", "--key", "k"], "b given twice; name it once"),
        (["sign", "b", "./b/", "--key", "k"], "b given twice; name it once"),
        (["push", "x/b", "x/../x/b", "--repo", "o/r"], "x/b and x/../x/b name the same folder; name it once"),
        (["verify", "b", "c", "b", "--model", "m"], "b given twice; name it once"),
        (["serve", "--model", "m", "--snapshots", ""], "argument --snapshots: an empty path (it would mean the current folder); give one"),
        (["prune", "--snapshots", "", "--apply"], "argument --snapshots: an empty path (it would mean the current folder); give one"),
        (["build", "--parent", ""], "argument --parent: an empty path (it would mean the current folder); give one"),
        (["serve", "--model", ""], "argument --model: an empty path (it would mean the current folder); give one"),
        (["build", "a", "--full", "--parent", "DIR"], "argument --parent: not allowed with argument --full"),
        (["build", "a", "--full", "--parent-check", "sample"], "--parent-check does not apply with --full; leave it out"),
        (["build", "--forc"], "unrecognized arguments: --forc"),
        (["build", "--js"], "unrecognized arguments: --js"),
        (["build", "--no-ch"], "unrecognized arguments: --no-ch"),
        (["build", "--sign", "k.key"], "unrecognized arguments: --sign"),
        (["prune", "--kee", "2"], "unrecognized arguments: --kee 2"),
        (["new", "n", "--model", "m", "--from-request", "r", "--prefix-messages", "-1"], "argument --prefix-messages: '-1': give 0 or more messages, e.g. --prefix-messages 2"),
        (["new", "n", "--model", "m", "--from-request", "r", "--prefix-messages", "one"], "argument --prefix-messages: 'one': give 0 or more messages, e.g. --prefix-messages 2"),
    ],
)  # fmt: skip
def test_usage_errors(argv: list[str], error: str, tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert usage_error(argv, capsys) == f"error: {error}"
    assert list(tmp_path.iterdir()) == []  # nothing made: no prefixes/, no bundles/


def snapshot_sets(root: Path, count: int) -> list[Path]:
    root.mkdir(mode=0o700)
    sets = [root / f"set-{n}" for n in range(1, count + 1)]
    for folder in sets:
        folder.mkdir()
        (folder / SET_MARK).write_bytes(MARK_TEXT)
    return sets


@pytest.mark.parametrize(
    ("before", "after", "option"),
    [
        ([], ["--keep", "3"], "--keep"),
        ([], ["--json"], "--json"),
        ([], ["--prefixes", "p"], "--prefixes"),
        (["--bundles", "b"], [], "--bundles"),
    ],
)
def test_prune_snapshots_takes_no_other_option(
    before: list, after: list, option: str, tmp_path: Path, capsys
):
    """--keep means versions per prefix: serve keeps one snapshot set, and prune --snapshots
    deletes every set, so a --keep (or any other option) there is refused, never ignored."""
    sets = snapshot_sets(tmp_path / "s", 3)
    argv = [*before, "prune", "--snapshots", str(tmp_path / "s"), *after, "--apply"]
    assert (
        usage_error(argv, capsys)
        == f"error: {option} does not apply to prune --snapshots; leave it out"
    )
    assert all(s.is_dir() for s in sets)
    assert main(["prune", "--snapshots", str(tmp_path / "s"), "--apply"]) == 0
    assert capsys.readouterr().out.startswith(f"deleted 3 folders under {tmp_path / 's'}")


@pytest.mark.parametrize("replace", [[], ["--replace"]])
def test_server_env_dry_run_refuses_what_the_run_refuses(replace: list, tmp_path: Path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    argv = ["server-env", "vllm-mlx", str(tmp_path), *replace]
    assert main([*argv, "--dry-run"]) == 1
    dry = capsys.readouterr()
    assert dry.out == ""
    assert main(argv) == 1
    assert capsys.readouterr().err.splitlines()[-1] == dry.err.strip()
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_schema_out_errors_name_the_path_and_the_fix(tmp_path: Path, capsys):
    file = tmp_path / "f"
    file.write_text("mine")
    fix = "name a folder this user can write (it is made when missing)"
    assert main(["schema", "--out", str(file)]) == 1
    assert (
        capsys.readouterr().err
        == f"error: schema --out {file}: it is a file, not a folder; {fix}\n"
    )
    assert main(["schema", "build", "--out", str(file / "x")]) == 1
    assert capsys.readouterr().err == (
        f"error: schema --out {file / 'x'}: cannot write {file / 'x'} (Not a directory); {fix}\n"
    )
    assert file.read_text() == "mine"


def test_new_prefix_messages_without_from_request_is_refused_even_at_zero(tmp_path: Path, capsys):
    argv = ["--prefixes", str(tmp_path / "p"), "new", "n", "--model", str(tmp_path / "m")]
    assert main([*argv, "--prefix-messages", "0"]) == 1
    assert (
        capsys.readouterr().err == "error: --server and --prefix-messages go with --from-request\n"
    )
    assert list(tmp_path.iterdir()) == []
