"""Shared pytest fixtures; keep each section small and add new ones under their own heading."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.blas import ensure_fast_blas
from pipeline.testmodels.model import generate_model

# Before any test module imports mlx: the tests' prefills run on OpenBLAS (see pipeline/blas.py).
ensure_fast_blas()

# --- This user's private cache folder (pipeline.format.memo) -------------------------------------


@pytest.fixture(scope="session", autouse=True)
def private_cache_folder(tmp_path_factory: pytest.TempPathFactory):
    """The session's own sha256 memo, build record and cache-class table: no test reads or fills
    the user's (~/.cache/mlx-prefix-bundles), so no run depends on what earlier runs left there.
    Servers and builds the tests start inherit it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path_factory.mktemp("user-cache")))
        yield


@pytest.fixture(autouse=True)
def working_folder_of_its_own(tmp_path_factory: pytest.TempPathFactory, monkeypatch):
    """Each test runs in an empty folder of its own: what `just demo` left in the checkout
    (bundles/ for the demo model, whose fingerprint the tiny test model shares) is never read by
    a command that falls back to the project's bundles/ (serve, match, verify)."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


# --- Generated test models (pipeline.testmodels.model) -------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny real-format Qwen3 model folder (seed 0), generated once per test session."""
    return generate_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def tiny_model_other_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tiny model with other weights (seed 1): same shapes, tokenizer and template."""
    return generate_model(tmp_path_factory.mktemp("models") / "tiny-seed1", seed=1)


# --- Test projects: a prefixes/ folder with definitions for the tiny model --------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Find an order by its id.",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string", "description": "The order id."}},
                "required": ["order_id"],
            },
        },
    }
]
SYSTEM = (
    "You are the support assistant of a small bookshop. Be brief, polite and exact. "
    "Never invent order numbers; look them up with the tools. Café opening hours: 9-17."
)


def model_template_sha(model_dir: Path) -> str:
    """sha256 of the chat template a model folder ships."""
    from pipeline.format.fingerprint import model_chat_template, sha256_text

    return sha256_text(model_chat_template(model_dir))


def write_definition(
    root: Path, model_dir: Path, name: str = "shop", extra: str = "", **cache
) -> Path:
    """Write prefixes/<name>.toml (system text + tools) for model_dir under root; return its path."""
    import json

    prefixes = root / "prefixes"
    (prefixes / name).mkdir(parents=True, exist_ok=True)
    (prefixes / name / "tools.json").write_text(json.dumps(TOOLS))
    cache_lines = "".join(f"{k} = {v}\n" for k, v in cache.items())
    path = prefixes / f"{name}.toml"
    path.write_text(
        f'name = "{name}"\nversion = 1\n{extra}\n'
        f'[template]\nsource = "model"\nsha256 = "{model_template_sha(model_dir)}"\n\n'
        f'[prefix]\ntools_file = "{name}/tools.json"\n\n'
        f'[[prefix.messages]]\nrole = "system"\ncontent = {json.dumps(SYSTEM)}\n\n'
        f'[[models]]\npath = "{model_dir}"\n\n[cache]\n{cache_lines}'
    )
    return path


@pytest.fixture
def project(tmp_path: Path, tiny_model: Path) -> Path:
    """A project folder with prefixes/shop.toml for the tiny model."""
    write_definition(tmp_path, tiny_model)
    return tmp_path


def build_bundle(project_root: Path, name: str = "shop", **kwargs) -> Path:
    """Build one definition of a test project; return the bundle folder."""
    from pipeline.builder.builder import build
    from pipeline.builder.definition import load_definition
    from pipeline.builder.targets import targets

    definition = load_definition(project_root / "prefixes" / f"{name}.toml", project_root)
    (target,) = targets(definition, project_root)
    return build(target, project_root / "bundles", **kwargs).bundle


@pytest.fixture(scope="session")
def shop_bundle(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """A bundle of the shop prefix for the tiny model, built once (checked)."""
    root = tmp_path_factory.mktemp("shop-project")
    write_definition(root, tiny_model)
    return build_bundle(root, check=True)


# --- --json documents (tests/test_json_output.py, tests/test_distribute.py) ----------------------


def document(model, text: str):
    """The one JSON document on stdout, checked strictly against its pydantic model."""
    import json

    doc = model.model_validate_json(text, strict=True)
    assert json.loads(text) == doc.model_dump(mode="json", by_alias=True)
    assert json.loads(text)["schema"] == model.model_fields["schema_"].default
    return doc


# --- Fuzz corpus summary (tests/test_fuzz.py) ----------------------------------------------------


def pytest_terminal_summary(terminalreporter) -> None:
    """Print the fuzz corpus counts (cases, refused, accepted with identical output)."""
    import sys

    fuzz = sys.modules.get("test_fuzz")
    if fuzz is not None and fuzz.SUMMARY:
        terminalreporter.write_line(f"fuzz corpus: {fuzz.SUMMARY}")


# --- A Claude-Code-shaped Anthropic messages request (tests/test_authoring.py, test_servers_vllm.py)


def claude_code_request(model: str, question: str = "Where is my order 12345?") -> dict:
    """An Anthropic /v1/messages body shaped like Claude Code's: a per-request billing-header
    block, the long system text in blocks with cache_control, many tools with input_schema."""
    import json

    demo = json.loads((Path(__file__).parents[1] / "prefixes/support-agent/tools.json").read_text())
    tools = [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in [*TOOLS, *demo]
    ]
    return {
        "model": model,
        "max_tokens": 8,
        "temperature": 0.0,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.3; cch=5f1e9;"},
            {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
            {
                "type": "text",
                "text": "Environment: working directory /srv/shop, platform linux.",
                "cache_control": {"type": "ephemeral"},
            },
        ],
        "tools": tools,
        "messages": [{"role": "user", "content": [{"type": "text", "text": question}]}],
    }
