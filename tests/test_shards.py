"""`build --shard I/N`: the shards partition the (definition, model) pairs exactly, on any machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.builder.definition import load_definition
from pipeline.builder.shards import Shard, pair_key, shard_refs
from pipeline.cli import main
from pipeline.cli.reports import BuildReport

from conftest import write_definition


def definitions_with_models(root: Path, tiny_model: Path, models: dict[str, int]) -> list:
    """Definitions named as given, each listing its count of models (hub and local refs mixed)."""
    loaded = []
    for name, count in models.items():
        path = write_definition(root, tiny_model, name=name)
        extra = "".join(
            f'\n[[models]]\nrepo = "org/m{i}"\nrevision = "{i:040x}"\n'
            if i % 2
            else f'\n[[models]]\npath = "models/m{i}"\n'
            for i in range(1, count)
        )
        path.write_text(path.read_text() + extra)
        loaded.append(load_definition(path, root))
    return loaded


def keys(definitions, refs: dict[str, list[str]]) -> set[str]:
    return {pair_key(d, r) for d in definitions for r in refs[d.name]}


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7, 12])
def test_shards_partition_the_pairs_exactly(tmp_path: Path, tiny_model: Path, count: int):
    definitions = definitions_with_models(tmp_path, tiny_model, {"a": 3, "b": 1, "c": 4, "d": 2})
    everything = keys(definitions, shard_refs(definitions, None, None))
    assert len(everything) == 10
    parts = [keys(definitions, shard_refs(definitions, None, Shard(i, count))) for i in range(1, count + 1)]  # fmt: skip
    assert set().union(*parts) == everything
    assert sum(len(p) for p in parts) == len(everything)  # disjoint
    assert max(map(len, parts)) - min(map(len, parts)) <= 1  # balanced
    again = definitions_with_models(
        tmp_path / "again", tiny_model, {"d": 2, "c": 4, "b": 1, "a": 3}
    )
    assert keys(again, shard_refs(again, None, Shard(1, count))) == parts[0]  # order-independent


def test_shard_keys_name_version_and_model(tmp_path: Path, tiny_model: Path):
    (d,) = definitions_with_models(tmp_path, tiny_model, {"a": 2})
    assert shard_refs([d], None, None) == {"a": [str(tiny_model), f"org/m1@{1:040x}"]}
    assert shard_refs([d], Path("models/x"), None) == {"a": ["models/x"]}
    assert pair_key(d, "models/x") == "a@1/models/x"


@pytest.mark.parametrize("text", ["0/2", "3/2", "1", "a/b", "1/0", "-1/2"])
def test_a_bad_shard_is_a_usage_error(text: str, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["build", f"--shard={text}"])
    assert exit_.value.code == 2
    assert "expected I/N with 1 <= I <= N, e.g. --shard 1/4" in capsys.readouterr().err


def test_build_shards_build_each_target_once(tmp_path: Path, tiny_model: Path, capsys):
    for name in ("one", "two", "three"):
        write_definition(tmp_path, tiny_model, name=name)
    folders = ["--prefixes", str(tmp_path / "prefixes"), "--bundles", str(tmp_path / "bundles")]
    built = []
    for i in (1, 2):
        assert main([*folders, "build", "--no-check", "--json", "--shard", f"{i}/2"]) == 0
        doc = BuildReport.model_validate_json(capsys.readouterr().out, strict=True)
        assert (doc.shard.index, doc.shard.count) == (i, 2)
        built += [(t.prefix, t.status) for t in doc.targets]
    assert sorted(built) == [("one", "built"), ("three", "built"), ("two", "built")]
    lock = json.loads((tmp_path / "prefixes" / "prefixes.lock").read_text())
    assert sorted(lock["prefixes"]) == ["one", "three", "two"]
