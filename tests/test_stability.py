"""The build proves its tokens are a prefix of every continuation, and refuses date-dependent templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlx_lm import load

from pipeline.builder.stability import common_prefix_length, stable_prefix
from pipeline.builder.template import render
from pipeline.format.bundle_folder import MANIFEST_FILE
from pipeline.format.errors import BuildError, TemplateError
from pipeline.format.fingerprint import sha256_text
from pipeline.runtime import PromptCacheManager, mount

from conftest import build_bundle

# A template that glues each message to the next with no separator: a prefix ending in a space
# and a next turn starting with a word become one pre-token (" word"), merging across the boundary.
GLUED = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
DATED = "Today is {{ strftime_now('%Y-%m-%d') }}.\n{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def write_file_template_definition(
    root: Path, model: Path, template: str, content: str, extra: str = ""
) -> None:
    prefixes = root / "prefixes"
    prefixes.mkdir(parents=True, exist_ok=True)
    (prefixes / "glued.jinja").write_text(template)
    (prefixes / "glued.toml").write_text(
        f'name = "glued"\nversion = 1\n\n[template]\nsource = "file"\nfile = "glued.jinja"\n'
        f'sha256 = "{sha256_text(template)}"\n{extra}\n'
        f'[[prefix.messages]]\nrole = "system"\ncontent = {json.dumps(content)}\n\n'
        f'[[models]]\npath = "{model}"\n'
    )


def test_merge_across_the_boundary_cuts_the_bundle_and_runtime_hits_stable_tokens(
    tmp_path: Path, tiny_model: Path
):
    write_file_template_definition(
        tmp_path, tiny_model, GLUED, "Answer every question about the weather "
    )
    bundle = build_bundle(tmp_path, "glued", check=True)
    tokens = json.loads((bundle / MANIFEST_FILE).read_text())["tokens"]
    assert tokens["stable_tokens"] < tokens["rendered_tokens"]
    assert tokens["count"] == tokens["stable_tokens"]

    _, tokenizer = load(str(tiny_model))
    request = [
        {"role": "system", "content": "Answer every question about the weather "},
        {"role": "user", "content": "today in Paris?"},
    ]
    ids = list(tokenizer.encode(render(GLUED, request), add_special_tokens=False))
    manager = PromptCacheManager()
    mount(tiny_model, bundle, manager=manager, model_key="m", chat_template=GLUED)
    assert manager.fetch("m", ids).cache_hit_tokens == tokens["stable_tokens"]


def test_prefix_ending_at_a_turn_boundary_is_fully_stable(shop_bundle: Path):
    tokens = json.loads((shop_bundle / MANIFEST_FILE).read_text())["tokens"]
    assert tokens["stable_tokens"] == tokens["rendered_tokens"] > 50


def test_date_dependent_template_is_refused_unless_pinned(tmp_path: Path, tiny_model: Path, caplog):
    write_file_template_definition(tmp_path, tiny_model, DATED, "Be brief.")
    with pytest.raises(
        TemplateError, match=r"depends on today's date \(strftime_now\); pin it with template.date"
    ):
        build_bundle(tmp_path, "glued")
    write_file_template_definition(
        tmp_path, tiny_model, DATED, "Be brief.", extra="date = 2026-01-15\n"
    )
    bundle = build_bundle(tmp_path, "glued")
    manifest = json.loads((bundle / MANIFEST_FILE).read_text())
    assert "Today is 2026-01-15." in manifest["text"]["preview"]
    assert manifest["model"]["template_date"] == "2026-01-15"

    import datetime

    (mounted,) = mount(tiny_model, bundle, chat_template=DATED).bundles
    assert mounted.date_warning(datetime.date(2026, 1, 15)) is None
    warning = mounted.date_warning(datetime.date(2026, 12, 3))
    assert "date pinned to 2026-01-15" in warning and "will not reuse it" in warning

    from pipeline.runtime.servers.startup import log_mounts

    log_mounts(mount(tiny_model, bundle, chat_template=DATED))  # serve warns at startup
    assert any("date pinned to 2026-01-15" in r.message for r in caplog.records)


def test_stable_prefix_on_plain_lists():
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    prefix, probe = list(range(1, 11)), [*range(1, 10), 99]
    cut = stable_prefix(prefix, [], ids_of=lambda conv: probe, decode=str)
    assert cut.tokens == prefix[:9] and cut.rendered_tokens == 10 and cut.probe_tokens == [99]


def test_too_few_stable_tokens_are_refused():
    with pytest.raises(BuildError, match="only 1 token"):
        stable_prefix([1, 2], [], lambda conv: [1, 3], str)
