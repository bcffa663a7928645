"""Manifest schema (format v5, reads v2-v4): everything a bundle's validity depends on, as a strict,
frozen record.

Strict on purpose: the runtime parses manifests it did not write (copied, edited, forged), so every
field has the type and range a builder can produce, and nothing else is accepted.

Format 3 added what tells two builders apart and what a parent was:
- `builder.kernels`: the device, mlx build and BLAS that made the bytes (required);
- `parent.manifest_sha256` and `parent.kernels`: the exact parent manifest the child continued and
  the kernels that made the parent's part (required with a parent);
- `parent.kind` and `parent.stored_dtype`: a child continues its parent's stored KV at the exact
  shared token (required with a parent); `fidelity.inherited`: the parent's serving-path
  comparison, for a child that did not run its own;
- `kind`: "prefix", or "snapshot" for a runtime snapshot (`serve --snapshots`: a server's own
  prompt-cache entry saved at a graceful stop; no prefix or text, a `snapshot` record instead);
- rapid-mlx among the servers a request's ids follow, and the `developer` role.
A format 2 manifest is still read and served; it is never continued as a parent (nothing in it says
which kernels made it).

Format 4 (snapshots only; a prefix bundle's manifest is unchanged, still format 3) adds
`snapshot.depends_on`: the bundles (NAME@VERSION and manifest sha256) whose K/V the snapshot may
continue. A format 3 snapshot lacks it, so it cannot prove its source: it is read, never restored.

Format 5 (prefix bundles; the next number after the snapshots' 4, so that one number never means
two things) adds `cache.blocks`: the cache file's token-range blocks (pipeline.format.cache_blocks,
the blobs an OCI artifact carries) pinned one sha256 each, with the header's and the rest's, so a
pull proves each block as it lands and a signature over the manifest covers every block. A
format 3 prefix bundle is still read and served (its file is proven whole, by its digests).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.format.cache_blocks import record_sha256
from pipeline.format.names import NAME_RULE

# 2: cache file digest and size in the manifest, fingerprinted model folders; 3: builder kernels,
# the parent's manifest digest, kind. READ_VERSIONS: what this runtime reads and can still prove.
# 5: cache.blocks (a prefix bundle's; snapshots stay format 4).
FORMAT_VERSION = 5
SNAPSHOT_FORMAT = 4  # format 3 and snapshot.depends_on (prefix bundles: format 3, then 5)
READ_VERSIONS = (2, 3, 4, 5)
BLOCKS_FORMAT = 5  # the first format with cache.blocks
MAX_MANIFEST_BYTES = 1 << 20

Hex64 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Count = Annotated[int, Field(ge=1, le=1 << 40)]
Short = Annotated[str, Field(max_length=4096)]
CacheClass = Literal["KVCache", "QuantizedKVCache", "RotatingKVCache", "ArraysCache"]
KVDtype = Literal["float32", "float16", "bfloat16"]
# the mlx-lm prompt-cache file layout of cache.safetensors (pipeline.format.cache_codec)
Layout = Literal["mlx-lm-0.31", "mlx-lm-0.32"]
# not written to manifest.json: manifests from before 0.31 support stay byte-identical
DEFAULT_LAYOUT = "mlx-lm-0.32"


class Record(BaseModel):
    # no NaN or Infinity: JSON has neither (strict parsers refuse `inspect --json` carrying one)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class PrefixInfo(Record):
    name: Annotated[str, Field(pattern=NAME_RULE)]
    version: Count
    content_sha256: Hex64


class TextInfo(Record):
    sha256: Hex64
    chars: Annotated[int, Field(ge=0)]
    preview: Annotated[str, Field(max_length=1024)]  # first and last characters of the prefix


class TokenInfo(Record):
    count: Count  # tokens stored in the bundle (the stable prefix)
    ids_sha256: Hex64
    rendered_tokens: Count  # tokens of the rendered prefix before the stability cut
    stable_tokens: Count

    @model_validator(mode="after")
    def _counts_agree(self) -> TokenInfo:
        if self.stable_tokens != self.count or self.rendered_tokens < self.count:
            raise ValueError(
                f"stable_tokens ({self.stable_tokens}) must be count ({self.count}), and "
                f"rendered_tokens ({self.rendered_tokens}) at least that"
            )
        return self


class ModelInfo(Record):
    slug: Annotated[str, Field(pattern=NAME_RULE)]
    fingerprint: Hex64
    tokenizer_fingerprint: Hex64
    template_sha256: Hex64
    template_source: Short  # "model" or "file:<name>"
    # the date strftime_now rendered (definition's template.date), when the template uses it
    template_date: Annotated[str, Field(pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$")] | None = None


# a manifest is read up to 1 MiB: ~74 bytes per pinned block leaves room for 12,000 (768k tokens
# at 64 tokens a block; an OCI artifact's 4 MiB manifest lists at most ~25,000 blobs)
MAX_BLOCKS = 12_000


class BlocksInfo(Record):
    """cache.safetensors as token-range blocks (format 5; pipeline.format.cache_blocks): the
    header, the rest and every block pinned by its sha256, which tile the file exactly. They are
    the blobs of the bundle's OCI artifact, so a pull proves each one as it lands."""

    block_tokens: Annotated[int, Field(ge=1, le=1 << 16)]  # B: tokens per block
    header_sha256: Hex64  # the file's first bytes: 8-byte length and JSON header
    rest_sha256: Hex64  # the tensors without a token axis, in file order
    sha256: Annotated[list[Hex64], Field(max_length=MAX_BLOCKS)]  # block k, k = 0, 1, ...
    # of the fields above (cache_blocks.record_sha256): an edited or torn record is refused when
    # the manifest is read, on every path, before a byte of the file is hashed
    record_sha256: Hex64

    @model_validator(mode="after")
    def _record_holds(self) -> BlocksInfo:
        found = record_sha256(self.block_tokens, self.header_sha256, self.rest_sha256, self.sha256)
        if found != self.record_sha256:
            raise ValueError(
                f"record_sha256 is {self.record_sha256[:12]}.., the record hashes to "
                f"{found[:12]}.. (an edited block record)"
            )
        return self


def blocks_info(block_tokens: int, header: str, rest: str, blocks: list[str]) -> BlocksInfo:
    """The record of a file's pieces, its record_sha256 computed."""
    return BlocksInfo(
        block_tokens=block_tokens,
        header_sha256=header,
        rest_sha256=rest,
        sha256=list(blocks),
        record_sha256=record_sha256(block_tokens, header, rest, blocks),
    )


class CacheInfo(Record):
    classes: Annotated[list[CacheClass], Field(min_length=1, max_length=4096)]
    dtype: KVDtype
    kv_bits: Literal[4, 8] | None
    kv_group_size: Literal[32, 64, 128]
    prefill_step_size: Annotated[int, Field(ge=1)]
    nbytes: Annotated[int, Field(ge=0)]  # bytes of the cache arrays
    file_sha256: Hex64  # of cache.safetensors: regenerating SHA256SUMS alone never passes
    file_blake3: Hex64  # the same bytes, as mount checks them (BLAKE3: several GB/s per core)
    file_bytes: Annotated[int, Field(ge=8)]
    layout: Layout = DEFAULT_LAYOUT  # the mlx-lm generation whose layout the file has
    blocks: BlocksInfo | None = None  # format 5 (required there)


class BuilderInfo(Record):
    pipeline: Short
    mlx: Short
    mlx_lm: Short
    platform: Short
    device: Short
    compute_dtype: Short
    # what decides the bytes (pipeline.builder.kernels): device, mlx build, BLAS; None: format 2
    kernels: Short | None = None


class ServingCheck(Record):
    """Warm from the bundle vs a cold prefill on the serving path: the model's own dtype, chunked
    as mlx_lm.server chunks a prompt."""

    dtype: Short
    device: Short
    chunk_tokens: Annotated[int, Field(ge=1)]
    same_as_builder: bool  # the serving path is the builder's path (same dtype and chunks)
    max_abs_logit_diff: float
    greedy_match: bool
    top2_margin: float  # the cold path's gap between its two best first tokens
    tie_within_tolerance: bool  # margin <= diff: the first greedy token is a coin toss


class ReuseCheck(Record):
    """A lossy bundle reused for the fewest tokens the runtime allows (the rest of the prefix and
    the probe prefilled on top), against the builder's full-precision cache reused the same way."""

    tokens: Count  # pipeline.runtime.prompt_cache.lossy_min_tokens of the prefix
    max_abs_logit_diff: float
    greedy_match: bool


class InheritedCheck(Record):
    """The serving-path comparison a child did not run itself (it would cost a cold prefill from
    token 0): that of the bundle that measured it, whose first `tokens` positions the child holds
    as they were stored."""

    bundle: Short  # prefix@version/folder of the bundle that measured it
    tokens: Count  # the child's first positions that are that bundle's
    serving: ServingCheck


class FidelityInfo(Record):
    checked: bool
    max_abs_logit_diff: float | None = None  # against the builder's own cold prefill
    threshold: float | None = None
    greedy_tokens: int | None = None
    greedy_match: bool | None = None
    probe: Short | None = None
    reference: Short | None = None  # the builder's path: compute dtype, device, chunks
    top2_margin: float | None = None  # the reference's gap between its two best first tokens
    tie_within_tolerance: bool | None = None  # margin <= diff: greedy_match says nothing
    serving: ServingCheck | None = None
    serving_skipped: Short | None = None  # why the serving-path comparison did not run
    shortest_reuse: ReuseCheck | None = None  # lossy bundles whose layers all trim
    # a child whose serving-path comparison did not run: the one of the bundle whose positions
    # it holds (its parent's, or what that parent inherited); format 3
    inherited: InheritedCheck | None = None


# how a child holds its parent's positions (format 3; absent in format 2, whose children reused a
# parent up to a chunk boundary and equal a build from token 0 byte for byte):
# "continued": its first reused_tokens positions are the parent's stored K/V bytes, unchanged, and
#   the new tokens were prefilled on top of them (as a server continues a cached prefix);
# "continued-quantized": the same continuation, then the whole cache quantized (kv_bits), as a
#   build from token 0 quantizes its own: the shared positions are the parent's, quantized
ParentKind = Literal["continued", "continued-quantized"]


class ParentInfo(Record):
    """The bundle an incremental build continued from (its cache file's sha256 pins the exact
    bytes): the child's first reused_tokens positions are that parent's state, so the child is as
    trustworthy as the parent; `checked` says what was verified of it before use. Build with
    --full for a child that owes nothing to another bundle."""

    prefix: Annotated[str, Field(pattern=NAME_RULE)]
    version: Count
    folder: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,127}$")]
    file_sha256: Hex64
    reused_tokens: Count
    checked: Short | None = None  # signature, chunks recomputed from token 0 (None: older builds)
    manifest_sha256: Hex64 | None = (
        None  # the parent manifest continued (pins all it was built for)
    )
    kernels: Short | None = None  # what made the parent's part (its builder.kernels)
    kind: ParentKind | None = None  # format 3 (required there): how the child holds its positions
    # format 3: the dtype of the parent's stored K/V that the new tokens attended to (upcast
    # exactly to the compute dtype when that is wider: a bfloat16 parent on a float32 builder)
    stored_dtype: KVDtype | None = None


# the servers a manifest may record, written once (pipeline.runtime.servers.registry lists the
# same names, each with its room: a test holds the two equal)
ServerName = Literal["mlx-lm", "vllm-mlx", "rapid-mlx", "mlx-omni-server", "mlx-openai-server"]
SERVER_NAMES: tuple[str, ...] = get_args(ServerName)
RequestApi = Literal["openai", "anthropic"]  # OpenAI chat completions or Anthropic messages


class RequestMessage(Record):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, Field(max_length=MAX_MANIFEST_BYTES)]


class RequestInfo(Record):
    """The prefix as the chat request a definition describes: what `serve --server NAME` runs
    through NAME's own request code at startup to check the bundle's ids."""

    messages: Annotated[list[RequestMessage], Field(min_length=1, max_length=4096)]
    # the tools as JSON text in the definition's key order (the manifest's keys are sorted; a
    # template renders tools in their own order)
    tools_json: Annotated[str, Field(max_length=MAX_MANIFEST_BYTES)] | None = None
    template_kwargs: dict[str, Any] = {}

    @field_validator("tools_json")
    @classmethod
    def _function_tools(cls, text: str | None) -> str | None:
        """OpenAI function tools, as a definition's tools_file holds them."""
        if text is None:
            return None
        try:
            tools = json.loads(text)
        except (ValueError, RecursionError):
            raise ValueError("not JSON") from None
        if not isinstance(tools, list) or not all(
            isinstance(t, dict)
            and t.get("type") == "function"
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)
            for t in tools
        ):
            raise ValueError('not a list of {"type": "function", "function": {"name": ...}} tools')
        return text

    # the form clients send it in (Anthropic: each system message one text block)
    api: RequestApi = "openai"
    # the servers whose own request code gave the ids; empty: the pinned template rendered by the
    # builder (mlx_lm.server's path)
    tokenization: Annotated[list[ServerName], Field(max_length=len(SERVER_NAMES))] = []


ManifestKind = Literal["prefix", "snapshot"]


class SourceInfo(Record):
    """A bundle a snapshot may continue: its K/V is served only while this very manifest is
    mounted and trusted."""

    bundle: Short  # NAME@VERSION
    manifest_sha256: Hex64  # of the bundle's manifest.json bytes (pins every other fact of it)


class SnapshotInfo(Record):
    """What a runtime snapshot was (kind "snapshot"): a server's own prompt-cache entry, written
    by `serve --snapshots` at a graceful stop and signed with that host's key."""

    server: ServerName  # whose prompt cache held it
    source: Short  # how it was produced: e.g. "mlx_lm.server prompt cache (assistant)"
    # it continues quantized KV (its own, or that of a lossy bundle or snapshot it may descend
    # from): held to the lossy reuse rule when mounted, whatever its stored classes say
    lossy: bool
    continued_from: Short | None = None  # NAME@VERSION of a mounted bundle covering its opening
    rank: Annotated[int, Field(ge=0, le=1 << 20)]  # 0: the hottest entry of its set
    # format 4: every bundle it may continue (empty: the server computed it from token 0)
    depends_on: Annotated[list[SourceInfo], Field(max_length=4096)] | None = None


class Manifest(Record):
    """Everything a bundle's validity depends on; deterministic for identical inputs."""

    format_version: Literal[2, 3, 4, 5]
    kind: ManifestKind | None = None  # format 3: "prefix" or "snapshot"
    prefix: PrefixInfo | None = None  # a prefix bundle's (required there); a snapshot has none
    text: TextInfo | None = None  # a prefix bundle's rendered text (required there)
    tokens: TokenInfo
    model: ModelInfo
    cache: CacheInfo
    builder: BuilderInfo
    fidelity: FidelityInfo
    build_key: Hex64
    parent: ParentInfo | None = None  # absent for a build from token 0
    request: RequestInfo | None = None  # absent before requests were recorded, or with documents
    snapshot: SnapshotInfo | None = None  # kind "snapshot" only

    @model_validator(mode="after")
    def _fields_of_its_format(self) -> Manifest:
        """Format 3 has kind, builder kernels and a pinned parent; format 2 has none of them."""
        v3 = self.format_version >= 3
        parent = self.parent
        facts = {
            "kind": self.kind is not None,
            "builder.kernels": self.builder.kernels is not None,
            "parent.manifest_sha256": parent is None or parent.manifest_sha256 is not None,
            "parent.kernels": parent is None or parent.kernels is not None,
            "parent.kind": parent is None or parent.kind is not None,
            "parent.stored_dtype": parent is None or parent.stored_dtype is not None,
        }
        if v3 and not all(facts.values()):
            missing = next(k for k, ok in facts.items() if not ok)
            raise ValueError(f"format_version 3 requires {missing}")
        if not v3 and (self.kind, self.builder.kernels) != (None, None):
            raise ValueError("kind and builder.kernels are format 3 fields")
        continued = parent is not None and (parent.kind, parent.stored_dtype) != (None, None)
        if not v3 and (continued or self.fidelity.inherited is not None):
            raise ValueError(
                "parent.kind, parent.stored_dtype and fidelity.inherited are format 3 fields"
            )
        if parent is not None and parent.reused_tokens > self.tokens.count:
            raise ValueError(
                f"parent.reused_tokens ({parent.reused_tokens}) is more than the bundle's "
                f"{self.tokens.count} tokens"
            )
        if (self.format_version == BLOCKS_FORMAT) != (self.cache.blocks is not None):
            raise ValueError(f"cache.blocks is required in format {BLOCKS_FORMAT} and only there")
        return self._fields_of_its_kind()

    def _fields_of_its_kind(self) -> Manifest:
        """A prefix bundle has prefix and text; a snapshot has its snapshot record, no prefix,
        text, parent or request."""
        if self.kind == "snapshot":
            if self.format_version == BLOCKS_FORMAT:
                raise ValueError(
                    f"format_version {BLOCKS_FORMAT} is a prefix bundle's (snapshots are format "
                    f"{SNAPSHOT_FORMAT})"
                )
            extra = [k for k in ("prefix", "text", "parent", "request") if getattr(self, k)]
            if self.snapshot is None or extra:
                raise ValueError(
                    f"a snapshot manifest has a snapshot record and no {', '.join(extra) or 'prefix'}"
                )
            if (self.format_version == SNAPSHOT_FORMAT) != (self.snapshot.depends_on is not None):
                raise ValueError(
                    f"snapshot.depends_on is required in format {SNAPSHOT_FORMAT} and only there"
                )
            if self.cache.kv_bits is not None and not self.snapshot.lossy:
                raise ValueError(
                    f"snapshot.lossy is false for {self.cache.kv_bits}-bit KV (cache.kv_bits): "
                    "quantized KV is lossy"
                )
            return self
        missing = [k for k in ("prefix", "text") if getattr(self, k) is None]
        if self.format_version == SNAPSHOT_FORMAT:
            raise ValueError(f"format_version {SNAPSHOT_FORMAT} is a snapshot's (kind snapshot)")
        if missing or self.snapshot is not None:
            raise ValueError(
                f"a prefix manifest requires {' and '.join(missing)}"
                if missing
                else "snapshot is a field of snapshot manifests (kind snapshot)"
            )
        return self


def manifest_bytes(manifest: Manifest) -> bytes:
    """Canonical manifest bytes: sorted keys, two-space indent, trailing newline; no `parent` key
    for a build from token 0 and no `cache.layout` for the 0.32 layout (so such manifests are as
    before incremental builds and 0.31 support existed)."""
    exclude: dict = {}
    if manifest.parent is None:
        exclude["parent"] = True
    if manifest.request is None:
        exclude["request"] = True
    for name in ("prefix", "text", "snapshot"):  # a prefix bundle has no snapshot, and back
        if getattr(manifest, name) is None:
            exclude[name] = True
    if manifest.cache.blocks is None:  # formats 2 to 4, as they were written
        exclude["cache"] = {"blocks"}
    if manifest.snapshot is not None and manifest.snapshot.depends_on is None:
        exclude["snapshot"] = {"depends_on"}  # format 3 snapshots, as they were written
    if manifest.format_version == 2:  # absent fields of format 2, as its builders wrote them
        exclude["kind"] = True
        exclude["builder"] = {"kernels"}
        if manifest.parent is not None:
            exclude["parent"] = {"manifest_sha256", "kernels", "kind", "stored_dtype"}
        exclude["fidelity"] = {"inherited"}
        if manifest.cache.layout == DEFAULT_LAYOUT:
            exclude["cache"] = {"layout", "blocks"}
    data = manifest.model_dump(mode="json", exclude=exclude or None)
    return (json.dumps(data, sort_keys=True, indent=2) + "\n").encode()
