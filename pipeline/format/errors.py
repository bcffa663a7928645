"""The one error family of the project: every expected failure is a PipelineError."""

import os
from pathlib import Path


class PipelineError(Exception):
    """Base of every error the pipeline raises on purpose; the message says what to do."""


class UsageError(PipelineError):
    """The command line or a call's arguments are wrong (a typo, a value out of range, an option
    without the one it needs): the CLI exits 2, never 1 as for a refused bundle."""


class DefinitionError(PipelineError):
    """A prefix definition file is invalid."""


class TemplateError(PipelineError):
    """A chat template is unpinned, changed, unsupported or fails to render."""


class ModelError(PipelineError):
    """A model folder is missing, unreadable or not loadable."""


class BuildError(PipelineError):
    """A build step failed (prefill, stability or fidelity check)."""


class BundleError(PipelineError):
    """A bundle is missing, corrupt or does not match the model it is mounted for."""

    def __init__(self, bundle: str, message: str, field: str | None = None) -> None:
        super().__init__(f"bundle {bundle}: {message}")
        self.bundle = bundle
        self.field = field
        self.reason = message
        self.check: str | None = None  # which validator stage refused it (set by validate)


def path_argument(value: object, name: str) -> Path:
    """A library call's folder or file argument as a Path; PipelineError naming it when it is not
    a path (a caller's mistake, never a TypeError from deep inside nor a bundle's refusal)."""
    if not isinstance(value, (str, os.PathLike)):
        raise PipelineError(f"{name} must be a path (str or Path), got {type(value).__name__}")
    return Path(value)
