"""Split a build over N machines: every (definition, model) pair goes to exactly one shard.

A pair's key is "<name>@<version>/<model>", the model as the definition names it (models.path, or
models.repo@revision; the --model folder when given). The keys of all pairs the command would
build are sorted; the k-th key (0-based) belongs to shard k mod N + 1. The same definitions and
arguments give the same split on every machine, and the shards partition the pairs exactly.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pipeline.builder.definition import LoadedDefinition, ModelSpec

SHARD = re.compile(r"^([0-9]{1,9})/([0-9]{1,9})\Z")  # ASCII digits only


@dataclass(frozen=True)
class Shard:
    index: int  # 1-based
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        """'I/N' with 1 <= I <= N; ValueError with the fix otherwise."""
        match = SHARD.match(text.strip())
        if not match or not 1 <= int(match[1]) <= int(match[2]):
            raise ValueError(f"--shard {text!r}: expected I/N with 1 <= I <= N, e.g. --shard 1/4")
        return cls(int(match[1]), int(match[2]))

    def select(self, keys: Iterable[str]) -> set[str]:
        """The keys of this shard: every count-th of the sorted distinct keys."""
        return set(sorted(set(keys))[self.index - 1 :: self.count])


def model_ref(spec: ModelSpec) -> str:
    """How a definition names a model: its path, or repo@revision."""
    return spec.path if spec.path is not None else f"{spec.repo}@{spec.revision}"


def model_refs(definition: LoadedDefinition, model_override: Path | None) -> list[str]:
    """The models a definition would be built for, in order, without resolving any."""
    if model_override is not None:
        return [str(model_override)]
    return [model_ref(spec) for spec in definition.spec.models]


def pair_key(definition: LoadedDefinition, ref: str) -> str:
    return f"{definition.name}@{definition.version}/{ref}"


def shard_refs(
    definitions: list[LoadedDefinition], model_override: Path | None, shard: Shard | None
) -> dict[str, list[str]]:
    """{definition name: the model refs this shard builds}, in definition order; all without shard."""
    refs = {d.name: model_refs(d, model_override) for d in definitions}
    if shard is None:
        return refs
    keys = shard.select(pair_key(d, r) for d in definitions for r in refs[d.name])
    return {d.name: [r for r in refs[d.name] if pair_key(d, r) in keys] for d in definitions}
