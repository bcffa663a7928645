"""Prefix definitions: the TOML schema people write, loading, and resolution of included files."""

from __future__ import annotations

import datetime as dt
import difflib
import hashlib
import re
import unicodedata
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from pipeline.builder.plain_data import json_problem, parse_json, parse_toml
from pipeline.format.errors import DefinitionError
from pipeline.format.fingerprint import canonical_json
from pipeline.format.manifest import RequestApi, ServerName
from pipeline.format.names import MAX_VERSION, NAME_RULE
from pipeline.format.regular_files import FileProblem, read_text

NAME_PATTERN = NAME_RULE  # for pydantic fields; Python code checks names with is_name()
MAX_INCLUDE_BYTES = 256 << 20
MAX_DEFINITION_BYTES = 4 << 20  # a definition names its long texts in included files


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# the roles a prefix message may have (developer: OpenAI's; each server's own request code decides
# what it becomes: vllm-mlx makes it system, mlx_lm.server hands it to the template as is)
Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = get_args(Role)


class MessageSpec(Strict):
    """One message of the prefix; content inline or concatenated from files."""

    role: Role
    content: str | None = None
    content_files: list[str] = Field(default_factory=list)
    # the pinned template drops this turn (Qwen3's drop a developer turn), as the server it was
    # captured from does: rendered with the others, so the prefix is what that server sends, and
    # build checks it stays dropped instead of refusing a turn it cannot see (`new --from-request`)
    dropped_by_template: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> MessageSpec:
        if (self.content is None) == (not self.content_files):
            raise ValueError("give exactly one of 'content' or 'content_files'")
        return self


class DocumentSpec(Strict):
    """A document passed to the template's `documents` variable (RAG-style templates)."""

    title: str
    file: str


class PrefixSpec(Strict):
    """What the prefix holds: messages, tool schemas, documents."""

    messages: list[MessageSpec] = Field(min_length=1)
    tools_file: str | None = None
    documents: list[DocumentSpec] = Field(default_factory=list)


class TemplateSpec(Strict):
    """The pinned chat template: the model's own or a file, with its sha256."""

    source: Literal["model", "file"] = "model"
    file: str | None = None
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    date: dt.date | None = None  # what strftime_now renders; pin it for date-dependent templates
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("kwargs")
    @classmethod
    def _plain_json(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        problem = json_problem(kwargs)  # hashed as JSON, sent as a request's chat_template_kwargs
        if problem:
            raise ValueError(problem)
        from pipeline.builder.template import RESERVED_TEMPLATE_VARIABLES

        reserved = [k for k in RESERVED_TEMPLATE_VARIABLES if k in kwargs]
        if reserved:
            raise ValueError(f"'{reserved[0]}' is set by the builder, not by kwargs; remove it")
        return kwargs

    @model_validator(mode="after")
    def _file_when_file(self) -> TemplateSpec:
        if (self.source == "file") != (self.file is not None):
            raise ValueError("'file' is required when source = \"file\" and only then")
        return self


class ModelSpec(Strict):
    """A model the prefix is built for: a local folder or a hub repo at a pinned revision."""

    path: str | None = None
    repo: str | None = None
    revision: str | None = None
    slug: str | None = Field(default=None, pattern=NAME_PATTERN)
    fingerprint: str | None = None

    @model_validator(mode="after")
    def _one_location(self) -> ModelSpec:
        if (self.path is None) == (self.repo is None):
            raise ValueError("give exactly one of 'path' or 'repo'")
        if self.repo is not None and not self.revision:
            raise ValueError("a hub 'repo' needs a pinned 'revision' (commit hash)")
        return self


class CacheSpec(Strict):
    """KV-cache options that change the bundle's bytes."""

    kv_bits: Literal[4, 8] | None = None
    kv_group_size: Literal[32, 64, 128] = 64
    # 2048 like mlx_lm: bigger chunks keep matmuls efficient (bench: 512 ran at 0.84x cache_prompt)
    prefill_step_size: int = Field(default=2048, ge=16, le=16384)
    # the prefill's dtype: "model" (the serving dtype: warm equals a server's cold prefill bit for
    # bit when chunks match) or "float32"; default: float32 on a CPU builder (no fast half-precision
    # CPU matmul), the model's dtype on a GPU
    compute_dtype: Literal["model", "float32"] | None = None


class CheckSpec(Strict):
    """Warm-equals-cold fidelity thresholds (defaults depend on kv_bits)."""

    max_abs_logit_diff: float | None = Field(default=None, ge=0)
    greedy_tokens: int = Field(default=8, ge=1, le=64)
    # compare against a cold prefill in the model's own dtype (the serving path); default: when
    # free or fast (the builder computes in that dtype, or runs on a GPU), else skipped and said so
    serving: bool | None = None


class PrefixDefinition(Strict):
    """A versioned prefix definition as written in prefixes/<name>.toml."""

    name: str = Field(pattern=NAME_PATTERN)
    version: int = Field(ge=1, le=MAX_VERSION, strict=True)
    description: str = ""
    template: TemplateSpec
    prefix: PrefixSpec
    models: list[ModelSpec] = Field(min_length=1)
    cache: CacheSpec = CacheSpec()
    check: CheckSpec = CheckSpec()
    # servers whose own request code gives the bundle's ids (pipeline.builder.server_ids); empty:
    # the pinned template as the builder renders it, which is mlx_lm.server's path
    servers: list[ServerName] = Field(default_factory=list, max_length=4)
    # the request form clients send the prefix in; "anthropic" (Anthropic messages: each system
    # message one text block, tools with input_schema) needs servers that serve that route
    api: RequestApi = "openai"

    @field_validator("servers")
    @classmethod
    def _each_server_once(cls, servers: list[str]) -> list[str]:
        if len(set(servers)) != len(servers):
            raise ValueError("name each server once")
        return servers


class FunctionSpec(BaseModel):
    """An OpenAI function tool's function: what chat templates render."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    """One entry of tools_file: {"type": "function", "function": {...}} as OpenAI defines it."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class LoadedDefinition(BaseModel):
    """A validated definition with its included files read and its content hash."""

    model_config = ConfigDict(frozen=True)

    spec: PrefixDefinition
    path: Path
    messages: list[dict[str, str]]
    tools: list[dict[str, Any]] | None
    documents: list[dict[str, str]] | None
    template_file_text: str | None  # the pinned template when template.source = "file"
    content_sha256: str

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def version(self) -> int:
        return self.spec.version


def load_definition(path: Path, repo_root: Path | None = None) -> LoadedDefinition:
    """Load, validate and resolve one definition file; raise DefinitionError naming file and field."""
    path = Path(path)
    root = (repo_root or path.parent.parent).resolve()
    return _resolve(read_definition(path), path, root)


def read_definition(path: Path) -> PrefixDefinition:
    """One definition file read and validated as written (nothing it names is read): a file
    that is not a definition is a DefinitionError naming file and field."""
    path = Path(path)
    try:  # never blocks on a FIFO, never reads a huge file
        text = read_text(path, MAX_DEFINITION_BYTES)
    except FileProblem as exc:
        raise DefinitionError(
            f"{path}: {exc}; a definition must be a regular UTF-8 TOML file (move anything "
            f"else out of {path.parent})"
        ) from None
    try:
        raw = parse_toml(text)
    except ValueError as exc:
        raise DefinitionError(f"{path}: not valid TOML ({exc}); fix the syntax") from None
    try:
        spec = PrefixDefinition.model_validate(raw)
    except ValidationError as exc:
        raise DefinitionError(f"{path}: {_first_error(exc)}") from None
    if spec.name != path.stem:
        raise DefinitionError(f"{path}: name: '{spec.name}' must equal the file name '{path.stem}'")
    return spec


# What to do, for fields whose pydantic message names the rule but not the fix.
FIELD_HINTS = {
    "name": "use 1-64 of a-z 0-9 . _ - starting with a letter or digit, and name the file the same",
    "version": "start at 1 and bump it whenever the content changes",
    "template.sha256": "pin the sha256 that the build's 'sha256 mismatch' error prints",
    "cache.kv_bits": "leave it out for a full-precision cache",
}


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err["loc"]) or "(top level)"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        known = _fields_at(PrefixDefinition, err["loc"][:-1])
        close = difflib.get_close_matches(str(err["loc"][-1]), known, n=1)
        guess = f" (did you mean '{close[0]}'?)" if close else ""
        return f"{field}: unknown field{guess}; remove it or check its spelling"
    if err["type"] == "missing":
        return f"{field}: required field is missing; add it"
    hint = FIELD_HINTS.get(re.sub(r"\.\d+\.", ".", field))
    if hint:
        return f"{field}: {msg} (got {err['input']!r}); {hint}"
    return f"{field}: {msg}"


def _fields_at(model: Any, loc: tuple) -> list[str]:
    """The field names of the (nested) model at `loc` in a definition ([] when unknown)."""
    for part in loc:
        if isinstance(part, int):
            continue  # a list index: the item's model is already found
        field = getattr(model, "model_fields", {}).get(part)
        model = _model_in(field.annotation) if field is not None else None
        if model is None:
            return []
    return list(getattr(model, "model_fields", {}))


def _model_in(annotation: Any) -> Any:
    """The pydantic model inside an annotation (X, list[X], X | None), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next(filter(None, (_model_in(a) for a in get_args(annotation))), None)


def _resolve(spec: PrefixDefinition, path: Path, root: Path) -> LoadedDefinition:
    base = path.parent.resolve()
    read = lambda rel, field: _read_included(rel, base, root, path, field)  # noqa: E731
    messages = [
        {
            "role": m.role,
            "content": m.content
            if m.content is not None
            else "\n\n".join(
                read(f, f"prefix.messages.{i}.content_files") for f in m.content_files
            ),
        }
        for i, m in enumerate(spec.prefix.messages)
    ]
    for i, message in enumerate(messages):
        if not message["content"].strip():
            raise DefinitionError(
                f"{path}: prefix.messages.{i}: content is empty; write the message text or remove the message"
            )
    tools = None
    if spec.prefix.tools_file:
        tools = _parse_tools(read(spec.prefix.tools_file, "prefix.tools_file"), path)
    documents = [
        {"title": d.title, "text": read(d.file, f"prefix.documents.{i}.file")}
        for i, d in enumerate(spec.prefix.documents)
    ] or None
    content = {
        "messages": messages,
        "tools": tools,
        "documents": documents,
        "template_kwargs": spec.template.kwargs,
        "template_date": spec.template.date.isoformat() if spec.template.date else None,
    }
    digest = hashlib.sha256(canonical_json(content)).hexdigest()
    template_text = None
    if spec.template.file is not None:
        template_text = read(spec.template.file, "template.file")
    return LoadedDefinition(
        spec=spec,
        path=path,
        messages=messages,
        tools=tools,
        documents=documents,
        template_file_text=template_text,
        content_sha256=digest,
    )


def _read_included(rel: str, base: Path, root: Path, path: Path, field: str) -> str:
    target = (base / rel).resolve()
    if not target.is_relative_to(base) or not target.is_relative_to(root):
        raise DefinitionError(
            f"{path}: {field}: '{rel}' is outside the definition's folder {base}; "
            "move the file under it"
        )
    try:
        return read_text(target, MAX_INCLUDE_BYTES)
    except FileProblem as exc:
        raise DefinitionError(
            f"{path}: {field}: included file '{rel}' {exc}; paths are relative to the "
            "definition's folder and must name regular UTF-8 text files"
        ) from None


def _parse_tools(text: str, path: Path) -> list[dict[str, Any]]:
    try:
        tools = parse_json(text)
    except ValueError as exc:
        raise DefinitionError(f"{path}: prefix.tools_file: not valid JSON ({exc})") from None
    problem = json_problem(tools)
    if problem:
        raise DefinitionError(f"{path}: prefix.tools_file: {problem}")
    if not isinstance(tools, list) or not tools:
        raise DefinitionError(
            f"{path}: prefix.tools_file: must hold a non-empty JSON list of tools"
        )
    for i, tool in enumerate(tools):
        try:
            ToolSpec.model_validate(tool)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "(the entry)"
            raise DefinitionError(
                f"{path}: prefix.tools_file: tool {i}: {where}: {err['msg']}; write OpenAI function "
                'tools: {"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}'
            ) from None
    return tools


def model_slug(spec: ModelSpec) -> str:
    """Folder name for a model's bundles: explicit slug, else derived from path or repo."""
    if spec.slug:
        return spec.slug
    if spec.path is not None:
        base = Path(spec.path).name
    else:
        base = f"{spec.repo.split('/')[-1]}-{spec.revision[:8]}"
    return slugify(base)


def slugify(text: str) -> str:
    """Lower-case ASCII, filesystem-safe name that NAME_PATTERN accepts."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    slug = re.sub(r"[^a-z0-9._-]+", "-", ascii_text.lower())[:64].strip("-._")
    return slug or "model"


def find_definitions(prefix_dir: Path) -> list[Path]:
    """All definition files in prefixes/, sorted by name."""
    return sorted(Path(prefix_dir).glob("*.toml"))


def require_definitions(prefix_dir: Path) -> list[Path]:
    """find_definitions, refusing a --prefixes folder that is missing or holds none."""
    paths = find_definitions(prefix_dir)
    if not paths:
        raise DefinitionError(f"no prefix definitions (*.toml) in {prefix_dir}/")
    return paths


def stray_definitions(prefix_dir: Path) -> list[Path]:
    """*.toml files in subfolders of prefixes/: never loaded, so worth a warning."""
    return sorted(p for p in Path(prefix_dir).glob("*/**/*.toml") if p.is_file())
