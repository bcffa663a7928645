"""Build targets: which model folders a definition is built for, and where each bundle goes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.builder.definition import LoadedDefinition, ModelSpec, model_slug, slugify
from pipeline.format.errors import ModelError
from pipeline.format.fingerprint import check_model_folder

HUB_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]


@dataclass(frozen=True)
class Target:
    """One (definition, model) pair to build."""

    definition: LoadedDefinition
    model_dir: Path
    slug: str
    model_ref: str  # the model as the definition or command line names it (for mlx_lm interop)
    expected_fingerprint: str | None = None


def resolve_model(spec: ModelSpec, root: Path) -> Path:
    """A local model folder for the spec: a path under the repo, or a hub snapshot at a revision."""
    if spec.path is not None:
        path = (root / spec.path).resolve()
        if not path.is_dir():
            raise ModelError(
                f"model {spec.path}: folder {path} does not exist; generate the demo model with "
                "'prefix-bundles demo-model', fix models.path or pass --model"
            )
        if not (path / "config.json").is_file():
            raise ModelError(
                f"model {spec.path}: no config.json in {path}; generate the demo model with "
                "'prefix-bundles demo-model' or fix models.path"
            )
        return path
    return hub_snapshot(spec.repo, spec.revision)


def hub_snapshot(repo: str, revision: str) -> Path:
    """The hub model at a revision: the local hub cache first, else a download if the hub answers.

    Offline (HF_HUB_OFFLINE) or with no network this fails in well under a second with one line,
    instead of huggingface_hub's ~25 s of retries.
    """
    from huggingface_hub import snapshot_download

    from pipeline.hubnet import require_hub

    ref = f"model {repo}@{revision}"
    try:
        local = snapshot_download(
            repo, revision=revision, allow_patterns=HUB_PATTERNS, local_files_only=True
        )
        if (Path(local) / "config.json").is_file():
            return Path(local)
    except Exception:  # not (completely) in the local hub cache: download it below
        pass
    require_hub(
        f"{ref}: not in the local hub cache",
        "download it with the hub reachable (HF_HUB_OFFLINE unset, network up), "
        "or pre-download it and use models.path",
        ModelError,
    )
    try:
        local = snapshot_download(repo, revision=revision, allow_patterns=HUB_PATTERNS)
    except Exception as exc:  # hub errors come in many types; all mean the same to the user
        raise ModelError(
            f"{ref}: download failed ({exc.__class__.__name__}); "
            "check the network and HF_TOKEN, or pre-download it and use models.path"
        ) from None
    return Path(local)


def targets(
    definition: LoadedDefinition,
    root: Path,
    model_override: Path | None = None,
    only: list[str] | None = None,
) -> list[Target]:
    """The models a definition is built for, or the one model given on the command line.

    `only` keeps the models whose reference (pipeline.builder.shards.model_refs) it lists; the
    others are never resolved (no hub download for another shard's model).
    """
    from pipeline.builder.shards import model_ref

    if only is not None and model_override is not None and str(model_override) not in only:
        return []
    if model_override is not None:
        check_model_folder(model_override)  # the --model folder, named as the user gave it
        path = Path(model_override).resolve()
        model_dir = resolve_model(ModelSpec(path=str(path)), root)
        ref = folder_ref(definition, root, model_dir)
        return [Target(definition, model_dir, slugify(path.name), ref)]
    return [
        Target(
            definition,
            resolve_model(spec, root),
            model_slug(spec),
            spec.path or spec.repo,
            spec.fingerprint,
        )
        for spec in definition.spec.models
        if only is None or model_ref(spec) in only
    ]


def folder_ref(definition: LoadedDefinition, root: Path, folder: Path) -> str:
    """How the bundle names a --model folder (its cache metadata, its build key): however the
    command line spells it (relative, absolute, through a link), the definition's own path when
    that is the same folder, else the folder relative to the project, else its real path; never
    the spelling, so the same inputs give the same bytes."""
    for spec in definition.spec.models:
        if spec.path is not None and (root / spec.path).resolve() == folder:
            return spec.path
    try:
        return folder.relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return str(folder)
