"""What every push starts from, whatever the back end: a local bundle the validator accepted
against the identity it records, and the identity of each of its files as validated.

The builder may not have the model a bundle is for, so push checks each bundle with
`recorded_identity(manifest)`: every file, checksum, the layout and every byte, but not the
fingerprints (pull checks those against the model it deploys to).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.distribute.pinned import FileId, file_ids
from pipeline.format.bundle_folder import model_folder, read_manifest
from pipeline.format.errors import PipelineError
from pipeline.format.validate import recorded_identity, validate


@dataclass(frozen=True)
class CheckedBundle:
    """A local bundle that passed the validator, and where it goes in the repo."""

    local: Path
    name: str
    version: int
    repo_path: str  # <name>/<version>/<slug>-<fingerprint[:12]>, as locally
    files: tuple[str, ...]
    cache_sha256: str
    tokens: int
    ids: tuple[tuple[str, FileId], ...] = ()  # each file's identity as validated (pinned.py)
    block_tokens: int | None = None  # the block size manifest.json pins (format 5), else the rule

    @property
    def label(self) -> str:
        return f"{self.name}@{self.version} ({self.repo_path.rsplit('/', 1)[1]})"


def check_bundle(bundle: Path, trust_memo: bool = False) -> CheckedBundle:
    """The full validator against the bundle's recorded identity; BundleError when refused
    (`trust_memo`: a cache file this user hashed in full, unchanged since, is not read again)."""
    bundle = Path(bundle)
    before = file_ids(bundle) if bundle.is_dir() else ()
    identity = recorded_identity(read_manifest(bundle, None))
    manifest = validate(bundle, identity, trust_memo=trust_memo).manifest
    ids = file_ids(bundle)
    if ids != before:  # rebuilt or edited meanwhile: what was validated is not what is there
        raise PipelineError(f"bundle {bundle}: it changed while it was validated; push it again")
    m = manifest
    return CheckedBundle(
        local=bundle,
        name=m.prefix.name,
        version=m.prefix.version,
        repo_path=f"{m.prefix.name}/{m.prefix.version}/{model_folder(m.model.slug, m.model.fingerprint)}",
        files=tuple(name for name, _ in ids),
        cache_sha256=m.cache.file_sha256,
        tokens=m.tokens.count,
        ids=ids,
        block_tokens=m.cache.blocks.block_tokens if m.cache.blocks else None,
    )
