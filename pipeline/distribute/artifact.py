"""One bundle as one OCI artifact: its media types, its stable tag, its manifest and config.

The artifact manifest (an OCI image manifest with our `artifactType`) lists, in order: the bundle's
small files as layers titled with their file name (manifest.json, SHA256SUMS, the signature and
build-report.json when present), the cache file's header, its "rest" blob (tensors without a
token axis), then its token-range blocks in token order (pipeline.distribute.blocks). The config
blob records what rebuilding cache.safetensors needs: token count, block size, file size and sha256.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.distribute.untrusted import Unfit, parse_as
from pipeline.format.bundle_folder import ALLOWED_FILES, CACHE_FILE
from pipeline.format.errors import PipelineError
from pipeline.format.names import MAX_VERSION, NAME_RULE, is_model_folder, is_name, parse_version

VENDOR = "application/vnd.mlx-prefix-bundles"
ARTIFACT_TYPE = f"{VENDOR}.bundle.v1"
CONFIG_TYPE = f"{VENDOR}.config.v1+json"
FILE_TYPE = f"{VENDOR}.file.v1"
HEADER_TYPE = f"{VENDOR}.cache-header.v1"
REST_TYPE = f"{VENDOR}.cache-rest.v1"
BLOCK_TYPE = f"{VENDOR}.kv-block.v1"
CONFIG_SCHEMA = "mlx-prefix-bundles.artifact/1"
TITLE = "org.opencontainers.image.title"
SMALL_FILES = tuple(sorted(ALLOWED_FILES - {CACHE_FILE}))
MAX_SMALL_BYTES = 16 << 20
MAX_MANIFEST_BYTES = 4 << 20  # distribution's own cap on a manifest body
MAX_CONFIG_BYTES = 1 << 20  # ours are ~250 bytes
# the header holds the token ids (~4-7 bytes each): 16 MiB is millions of tokens
MAX_HEADER_BYTES = 16 << 20
MAX_RECORDED_BLOCK_TOKENS = 1 << 16  # what a pull accepts from an artifact's config
# <name>.V<version>.<slug>-<fp12>: names and slugs are lower case, so the first "V" separates
TAG_RULE = re.compile(r"^(?P<name>[a-z0-9._-]+)\.V(?P<version>[0-9]+)\.(?P<folder>[a-z0-9._-]+)\Z")


@dataclass(frozen=True)
class Blob:
    media_type: str
    digest: str
    size: int
    title: str | None = None

    def descriptor(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.title:
            d["annotations"] = {TITLE: self.title}
        return d


def tag_of(name: str, version: int, folder: str) -> str:
    tag = f"{name}.V{version}.{folder}"
    if len(tag) > 128:
        raise PipelineError(
            f"bundle {name}/{version}/{folder}: its OCI tag {tag[:40]}.. would be {len(tag)} "
            "characters, over the 128 a registry takes; shorten the prefix name or model slug"
        )
    return tag


def parse_tag(tag: str) -> tuple[str, int, str] | None:
    """(name, version, folder) of a bundle tag; None for any other tag."""
    m = TAG_RULE.match(tag)
    version = parse_version(m["version"]) if m else None
    if not m or version is None or not is_name(m["name"]) or not is_model_folder(m["folder"]):
        return None
    return m["name"], version, m["folder"]


def config_record(
    name: str, version: int, folder: str, tokens: int, block_tokens: int, file_bytes: int, sha: str
) -> bytes:
    record = {
        "schema": CONFIG_SCHEMA,
        "prefix": name,
        "version": version,
        "folder": folder,
        "tokens": tokens,
        "block_tokens": block_tokens,
        "file_bytes": file_bytes,
        "cache_sha256": sha,
    }
    return (json.dumps(record, sort_keys=True, indent=1) + "\n").encode()


class ArtifactConfig(BaseModel):
    """The config blob as a pull reads it back (config_record writes it)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    schema_: Literal[CONFIG_SCHEMA] = Field(alias="schema")
    prefix: Annotated[str, Field(pattern=NAME_RULE)]
    version: Annotated[int, Field(ge=1, le=MAX_VERSION)]
    folder: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]*-[0-9a-f]{12}$", max_length=128)]
    tokens: Annotated[int, Field(ge=1, le=1 << 40)]
    block_tokens: Annotated[int, Field(ge=1, le=MAX_RECORDED_BLOCK_TOKENS)]
    file_bytes: Annotated[int, Field(ge=8, le=1 << 50)]
    cache_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


def parse_config(data: bytes) -> ArtifactConfig:
    """config_record's bytes read back; ValueError saying what is wrong and what to do."""
    try:
        return parse_as(ArtifactConfig, data, MAX_CONFIG_BYTES)
    except Unfit as exc:
        for e in exc.errors:
            if e["loc"] == ("schema",) and e["type"] == "literal_error":
                found = str(e["input"])[:60]
                raise ValueError(
                    f"has schema {found!r}, not {CONFIG_SCHEMA}; upgrade prefix-bundles"
                ) from None
        raise ValueError(f"is not a bundle artifact's ({exc}); push it again") from None


def manifest_body(config: Blob, layers: list[Blob], annotations: dict[str, str]) -> bytes:
    body = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "artifactType": ARTIFACT_TYPE,
        "config": config.descriptor(),
        "layers": [b.descriptor() for b in layers],
        "annotations": annotations,
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Parsed:
    """An artifact manifest read back: its config and its layers by role."""

    config: Blob
    files: list[Blob]
    header: Blob
    rest: Blob
    blocks: list[Blob]


class Descriptor(BaseModel):
    """One descriptor of an OCI manifest, as far as a pull reads it."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    mediaType: Annotated[str, Field(max_length=255)]  # noqa: N815 - the OCI field name
    digest: Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")]
    size: Annotated[int, Field(ge=0, le=1 << 50)]
    annotations: dict[str, str] | None = None

    def blob(self) -> Blob:
        return Blob(self.mediaType, self.digest, self.size, (self.annotations or {}).get(TITLE))


class ImageManifest(BaseModel):
    """An artifact manifest (an OCI image manifest with our artifactType), as a pull reads it."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    artifactType: Literal[ARTIFACT_TYPE]  # noqa: N815
    config: Descriptor
    layers: Annotated[list[Descriptor], Field(max_length=1 << 20)]


def parse_manifest(body: bytes, where: str) -> Parsed:
    """The roles of an artifact manifest's layers; PipelineError when it is not our artifact."""
    try:
        m = parse_as(ImageManifest, body, MAX_MANIFEST_BYTES)
    except Unfit as exc:
        raise PipelineError(
            f"{where}: not a prefix-bundle artifact ({exc}); push it with 'prefix-bundles push "
            "--repo oci://...'; nothing was published"
        ) from None
    config, layers = m.config.blob(), [d.blob() for d in m.layers]
    by = {t: [b for b in layers if b.media_type == t] for t in (FILE_TYPE, HEADER_TYPE, REST_TYPE)}
    files = by[FILE_TYPE]
    if (
        config.media_type != CONFIG_TYPE
        or len(by[HEADER_TYPE]) != 1
        or len(by[REST_TYPE]) != 1
        or any(b.title not in SMALL_FILES or b.size > MAX_SMALL_BYTES for b in files)
        or len({b.title for b in files}) != len(files)
    ):
        raise PipelineError(
            f"{where}: the artifact's layers are not a bundle's; push it again; nothing was "
            "published"
        )
    header = by[HEADER_TYPE][0]
    for what, blob, cap in (
        ("config", config, MAX_CONFIG_BYTES),
        ("header", header, MAX_HEADER_BYTES),
    ):
        if blob.size > cap:
            raise PipelineError(
                f"{where}: its {what} blob {blob.digest[:19]} is {blob.size:,} bytes, over the "
                f"{cap:,} a bundle's {what} may have (not read); push it again; nothing was published"
            )
    blocks = [b for b in layers if b.media_type == BLOCK_TYPE]
    return Parsed(config, files, header, by[REST_TYPE][0], blocks)
