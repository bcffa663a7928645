"""Mutations of a pristine bundle: what a careless deploy script, a bad disk or an attacker does.

Each mutation edits a copy of the bundle in place. A seal level then says how much the mutator
covered its tracks: "raw" (nothing), "sums" (SHA256SUMS recomputed, as `sha256sum` would), or
"resealed" (also the manifest's record of cache.safetensors' digests and size, and of its blocks
in format 5, where the file still cuts into blocks). Data-value edits are
not resealed: a mutator who rewrites the manifest's digest of the data itself is indistinguishable
from a builder without signatures, so the main corpus claims nothing there; `signature_corpus`
covers it (the forged bundle) and the signature file itself, given a trusted key.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.format.bundle_folder import (
    CACHE_FILE,
    MANIFEST_FILE,
    REPORT_FILE,
    SIGNATURE_FILE,
    SUMS_FILE,
)
from pipeline.format.bundle_writer import block_record
from pipeline.format.fingerprint import file_digests, sha256_file
from pipeline.format.secret_key import SecretKey

Mutation = Callable[[Path], None]
SEALS = ("raw", "sums", "resealed")


@dataclass(frozen=True)
class Case:
    name: str
    mutate: Mutation
    seals: tuple[str, ...] = SEALS

    def ids(self) -> list[str]:
        return [f"{self.name}/{seal}" for seal in self.seals]


# --- sealing ------------------------------------------------------------------------------------


def _regular(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def reseal_sums(bundle: Path) -> None:
    """Recompute SHA256SUMS from the files as they now are (what `sha256sum a b > SHA256SUMS` does)."""
    files = [n for n in (CACHE_FILE, MANIFEST_FILE) if _regular(bundle / n)]
    if (bundle / SUMS_FILE).is_symlink() or (bundle / SUMS_FILE).is_dir():
        return
    (bundle / SUMS_FILE).write_text("".join(f"{sha256_file(bundle / n)}  {n}\n" for n in files))


def reseal_manifest(bundle: Path) -> None:
    """Point the manifest at the cache file as it now is, then recompute SHA256SUMS."""
    path = bundle / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
        cache = bundle / CACHE_FILE
        digests = file_digests(cache)
        manifest["cache"]["file_sha256"] = digests.sha256
        manifest["cache"]["file_blake3"] = digests.blake3
        manifest["cache"]["file_bytes"] = digests.size
        if "blocks" in manifest["cache"]:  # format 5: the blocks the file now has, where it has
            found = _block_record(cache, manifest["tokens"]["count"])
            manifest["cache"]["blocks"] = found or manifest["cache"]["blocks"]
    except (OSError, ValueError, TypeError, KeyError, RecursionError):
        return reseal_sums(bundle)
    path.write_text(json.dumps(manifest, sort_keys=True, indent=2) + "\n")
    reseal_sums(bundle)


def _block_record(cache: Path, tokens: int) -> Any:
    """cache.blocks of the file as it is (as a builder writes it); an unreadable header or one
    that does not tile the file has none (None: the manifest's record is left as it was)."""
    try:
        return block_record(cache, tokens).model_dump(mode="json")
    except Exception:  # noqa: BLE001 - not a file blocks can be cut from
        return None


def apply(case: Case, seal: str, pristine: Path, dest: Path) -> Path:
    shutil.copytree(pristine, dest)
    case.mutate(dest)
    if seal == "sums":
        reseal_sums(dest)
    elif seal == "resealed":
        reseal_manifest(dest)
    return dest


# --- safetensors surgery ------------------------------------------------------------------------


def split_safetensors(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def join_safetensors(path: Path, header: dict[str, Any], data: bytes) -> None:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def edit_header(fn: Callable[[dict[str, Any]], None]) -> Mutation:
    def mutate(bundle: Path) -> None:
        header, data = split_safetensors(bundle / CACHE_FILE)
        fn(header)
        join_safetensors(bundle / CACHE_FILE, header, data)

    return mutate


def tensors_of(header: dict[str, Any]) -> list[str]:
    return sorted(k for k in header if k != "__metadata__")


def drop_layer(layer: str) -> Mutation:
    """Remove one layer's tensors and data, keeping the file a valid safetensors file."""

    def mutate(bundle: Path) -> None:
        header, data = split_safetensors(bundle / CACHE_FILE)
        meta = header.pop("__metadata__")
        kept = sorted(
            ((k, v) for k, v in header.items() if not k.startswith(layer + ".")),
            key=lambda kv: kv[1]["data_offsets"][0],
        )
        out, blob = {"__metadata__": meta}, b""
        for name, info in kept:
            a, b = info["data_offsets"]
            out[name] = {**info, "data_offsets": [len(blob), len(blob) + b - a]}
            blob += data[a:b]
        join_safetensors(bundle / CACHE_FILE, out, blob)

    return mutate


def cut_positions(keep: int) -> Mutation:
    """K/V cut to the first `keep` positions, shapes and offsets consistent (a valid file)."""

    def mutate(bundle: Path) -> None:
        header, data = split_safetensors(bundle / CACHE_FILE)
        meta = header.pop("__metadata__")
        out, blob = {"__metadata__": meta}, b""
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            a, b = info["data_offsets"]
            chunk = data[a:b]
            if len(info["shape"]) == 4:
                _, heads, t, d = info["shape"]
                row = (b - a) // (heads * t)
                chunk = b"".join(chunk[h * t * row : (h * t + keep) * row] for h in range(heads))
                info = {**info, "shape": [1, heads, keep, d]}
            out[name] = {**info, "data_offsets": [len(blob), len(blob) + len(chunk)]}
            blob += chunk
        join_safetensors(bundle / CACHE_FILE, out, blob)

    return mutate


# --- byte-level ---------------------------------------------------------------------------------


def flip(name: str, where: Callable[[int], int], mask: int = 0x01) -> Mutation:
    def mutate(bundle: Path) -> None:
        data = bytearray((bundle / name).read_bytes())
        if data:
            data[where(len(data)) % len(data)] ^= mask
        (bundle / name).write_bytes(bytes(data))

    return mutate


def truncate(name: str, keep: Callable[[int], int]) -> Mutation:
    def mutate(bundle: Path) -> None:
        data = (bundle / name).read_bytes()
        (bundle / name).write_bytes(data[: max(0, keep(len(data)))])

    return mutate


def append(name: str, extra: bytes) -> Mutation:
    def mutate(bundle: Path) -> None:
        with open(bundle / name, "ab") as fh:
            fh.write(extra)

    return mutate


def replace(name: str, content: bytes) -> Mutation:
    def mutate(bundle: Path) -> None:
        (bundle / name).write_bytes(content)

    return mutate


# --- manifest -----------------------------------------------------------------------------------


def edit_manifest(fn: Callable[[dict[str, Any]], Any]) -> Mutation:
    def mutate(bundle: Path) -> None:
        manifest = json.loads((bundle / MANIFEST_FILE).read_text())
        result = fn(manifest)
        value = manifest if result is None else result
        (bundle / MANIFEST_FILE).write_text(json.dumps(value, sort_keys=True, indent=2) + "\n")

    return mutate


def leaf_paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in leaf_paths(v, (*prefix, k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in leaf_paths(v, (*prefix, i))] or [prefix]
    return [prefix]


def set_path(path: tuple, fn: Callable[[Any], Any]) -> Callable[[dict], None]:
    def edit(manifest: dict) -> None:
        node = manifest
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = fn(node[path[-1]])

    return edit


def del_path(path: tuple) -> Callable[[dict], None]:
    def edit(manifest: dict) -> None:
        node = manifest
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    return edit


def changed(value: Any) -> Any:
    """A plausible different value of the same type."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 0.5
    if isinstance(value, str):
        if len(value) == 64 and all(c in "0123456789abcdef" for c in value):
            return ("0" if value[0] != "0" else "1") + value[1:]
        return value + "x"
    return 0


CONFUSIONS = {
    "null": lambda v: None,
    "string": lambda v: str(v),
    "list": lambda v: [v],
    "object": lambda v: {"v": v},
    "float": lambda v: 1.5,
    "bool": lambda v: True,
    "negative": lambda v: -1,
    "huge": lambda v: 10**30,
}


# --- folder -------------------------------------------------------------------------------------


def add_file(name: str, content: bytes = b"x") -> Mutation:
    return lambda bundle: (bundle / name).write_bytes(content)


def remove(name: str) -> Mutation:
    return lambda bundle: (bundle / name).unlink()


def symlink_to_copy(name: str) -> Mutation:
    def mutate(bundle: Path) -> None:
        copy = bundle.parent / f"{bundle.name}-{name}.copy"
        shutil.copy(bundle / name, copy)
        (bundle / name).unlink()
        (bundle / name).symlink_to(copy)

    return mutate


def fifo_instead(name: str) -> Mutation:
    def mutate(bundle: Path) -> None:
        (bundle / name).unlink()
        os.mkfifo(bundle / name)

    return mutate


def dir_instead(name: str) -> Mutation:
    def mutate(bundle: Path) -> None:
        (bundle / name).unlink(missing_ok=True)
        (bundle / name).mkdir()

    return mutate


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# --- the corpus ---------------------------------------------------------------------------------


def corpus(pristine: Path) -> list[Case]:
    """Every mutation, derived from the pristine bundle's own header and manifest."""
    header, data = split_safetensors(pristine / CACHE_FILE)
    header_len = len((pristine / CACHE_FILE).read_bytes()) - len(data)
    manifest = json.loads((pristine / MANIFEST_FILE).read_text())
    names = tensors_of(header)
    cases: list[Case] = []
    add = lambda name, fn, seals=SEALS: cases.append(Case(name, fn, seals))  # noqa: E731

    # bytes of cache.safetensors: length prefix, header JSON, data (data edits are not resealed)
    for i in range(8):
        add(f"cache-length-byte-{i}", flip(CACHE_FILE, lambda n, i=i: i, 0x40))
    for k in range(48):
        pos = 8 + (header_len - 8) * k // 48
        add(f"cache-header-byte-{pos}", flip(CACHE_FILE, lambda n, p=pos: p, 0x01))
    for k in range(24):
        pos = header_len + len(data) * k // 24
        add(f"cache-data-byte-{pos}", flip(CACHE_FILE, lambda n, p=pos: p, 0x80), ("raw", "sums"))
    add("cache-last-byte", flip(CACHE_FILE, lambda n: n - 1), ("raw", "sums"))
    for label, keep in {
        "empty": lambda n: 0, "4": lambda n: 4, "8": lambda n: 8, "mid-header": lambda n: header_len // 2,
        "header-only": lambda n: header_len, "mid-data": lambda n: header_len + len(data) // 2,
        "minus-1": lambda n: n - 1, "minus-4": lambda n: n - 4,
    }.items():  # fmt: skip
        add(f"cache-truncated-{label}", truncate(CACHE_FILE, keep))
    for label, extra in {"zero": b"\0", "8-zeros": bytes(8), "text": b"extra"}.items():
        add(f"cache-appended-{label}", append(CACHE_FILE, extra))
    add("cache-not-safetensors", replace(CACHE_FILE, b"\xff" * 64))
    add("cache-huge-header-length", replace(CACHE_FILE, struct.pack("<Q", 1 << 60) + b"{}"))

    # header surgery: dtypes, shapes, offsets, tensors, layers, metadata
    for name in names:
        dtype = header[name]["dtype"]
        for new in ("I32", "U32", "F16", "BF16", "F64", "U8", "XX"):
            if new != dtype:
                add(
                    f"dtype-{name}-{new}",
                    edit_header(lambda h, n=name, d=new: h[n].update(dtype=d)),
                )
        shape = header[name]["shape"]
        edits = {"add-dim": [*shape, 1], "drop-dim": shape[:-1], "zero": [0] * len(shape)}
        if len(shape) == 4:
            edits |= {"cut-tokens": [shape[0], shape[1], 20, shape[3]], "heads": [shape[0], shape[1] * 2, shape[2], shape[3] // 2], "batch-2": [2, shape[1], shape[2] // 2, shape[3]]}  # fmt: skip
        for label, new_shape in edits.items():
            add(
                f"shape-{name}-{label}",
                edit_header(lambda h, n=name, s=new_shape: h[n].update(shape=s)),
            )
        add(f"offsets-{name}-shift", edit_header(lambda h, n=name: h[n].update(data_offsets=[h[n]["data_offsets"][0] + 4, h[n]["data_offsets"][1] + 4])))  # fmt: skip
        add(f"offsets-{name}-missing", edit_header(lambda h, n=name: h[n].pop("data_offsets")))
        add(
            f"offsets-{name}-string", edit_header(lambda h, n=name: h[n].update(data_offsets="0,4"))
        )
        add(f"tensor-{name}-extra-key", edit_header(lambda h, n=name: h[n].update(extra=1)))
        add(f"tensor-{name}-renamed", edit_header(lambda h, n=name: h.update({n + "x": h.pop(n)})))
    # keys and values rewired: a data edit in effect, so not resealed (see the module docstring)
    add("tensors-swapped", edit_header(lambda h: h.update({names[0]: h[names[1]], names[1]: h[names[0]]})), ("raw", "sums"))  # fmt: skip
    add("layer-1-removed", drop_layer("1"))
    add("layer-0-removed", drop_layer("0"))
    add("kv-cut-to-20", cut_positions(20))
    add("kv-cut-to-1", cut_positions(1))

    meta = header["__metadata__"]
    # "0.token_ids" in the mlx-lm 0.32 layout, "1.token_ids" in 0.31's (pipeline.format.cache_codec)
    (token_key,) = [k for k in meta if k.endswith(".token_ids")]
    token_ids = json.loads(meta[token_key])
    for key in sorted(meta):
        add(f"meta-{key}-removed", edit_header(lambda h, k=key: h["__metadata__"].pop(k)))
        add(f"meta-{key}-changed", edit_header(lambda h, k=key: h["__metadata__"].update({k: h["__metadata__"][k] + "x"})))  # fmt: skip
    token_edits = {
        "last-dropped": token_ids[:-1], "first-changed": [token_ids[0] + 1, *token_ids[1:]],
        "one-added": [*token_ids, 5], "out-of-vocab": [*token_ids[:-1], 10**6], "negative": [*token_ids[:-1], -1],
        "floats": [float(t) for t in token_ids], "strings": [str(t) for t in token_ids], "bools": [True] * len(token_ids),
        "nested": [token_ids], "object": {"ids": token_ids},
    }  # fmt: skip
    for label, ids in token_edits.items():
        add(f"token-ids-{label}", edit_header(lambda h, v=ids: h["__metadata__"].update({token_key: json.dumps(v)})))  # fmt: skip
    add("token-ids-spaced", edit_header(lambda h: h["__metadata__"].update({token_key: json.dumps(token_ids)})))  # fmt: skip
    add(
        "token-ids-not-json",
        edit_header(lambda h: h["__metadata__"].update({token_key: "[1,2"})),
    )
    add("token-ids-deep", edit_header(lambda h: h["__metadata__"].update({token_key: nested(100_000).decode()})))  # fmt: skip
    for cls in (
        "RotatingKVCache",
        "QuantizedKVCache",
        "ArraysCache",
        "ChunkedKVCache",
        "Foo",
        "__class__",
    ):
        add(f"class-{cls}", edit_header(lambda h, c=cls: h["__metadata__"].update({"1.0": c})))
    add("meta-extra-key", edit_header(lambda h: h["__metadata__"].update({"0.extra": "x"})))
    add("meta-extra-class", edit_header(lambda h: h["__metadata__"].update({"1.2": "KVCache"})))
    add("scalar-kind-string", edit_header(lambda h: h["__metadata__"].update({"2.1.1": "string"})))
    add("scalar-kind-none", edit_header(lambda h: h["__metadata__"].update({"2.1.1": "none"})))
    add("scalar-kind-bogus", edit_header(lambda h: h["__metadata__"].update({"2.1.1": "pickle"})))
    add(
        "metadata-not-strings",
        edit_header(lambda h: h.update({"__metadata__": {token_key: 1}})),
    )

    # manifest: every leaf changed, confused, deleted; whole-document replacements
    for path in leaf_paths(manifest):
        label = ".".join(map(str, path))
        add(f"manifest-{label}-changed", edit_manifest(set_path(path, changed)), ("raw", "sums"))
        add(f"manifest-{label}-deleted", edit_manifest(del_path(path)), ("sums",))
        for kind in ("null", "string", "list"):
            add(
                f"manifest-{label}-{kind}",
                edit_manifest(set_path(path, CONFUSIONS[kind])),
                ("sums",),
            )
    for section in ("cache", "tokens", "model", "prefix"):
        add(f"manifest-{section}-extra-field", edit_manifest(lambda m, s=section: m[s].update(extra=1)), ("sums",))  # fmt: skip
        add(
            f"manifest-{section}-null",
            edit_manifest(lambda m, s=section: m.update({s: None})),
            ("sums",),
        )
    for kind, fn in CONFUSIONS.items():
        add(f"manifest-count-{kind}", edit_manifest(set_path(("tokens", "count"), fn)), ("sums",))
        add(
            f"manifest-kv-bits-{kind}", edit_manifest(set_path(("cache", "kv_bits"), fn)), ("sums",)
        )
    add(
        "manifest-group-size-0",
        edit_manifest(set_path(("cache", "kv_group_size"), lambda v: 0)),
        ("sums",),
    )
    add("manifest-kv-bits-8", edit_manifest(set_path(("cache", "kv_bits"), lambda v: 8)), ("sums",))
    add(
        "manifest-dtype-bfloat16",
        edit_manifest(set_path(("cache", "dtype"), lambda v: "bfloat16")),
        ("sums",),
    )
    add(
        "manifest-dtype-int32",
        edit_manifest(set_path(("cache", "dtype"), lambda v: "int32")),
        ("sums",),
    )
    add(
        "manifest-one-class",
        edit_manifest(set_path(("cache", "classes"), lambda v: v[:1])),
        ("sums",),
    )
    add(
        "manifest-format-next",
        edit_manifest(set_path(("format_version",), lambda v: v + 1)),
        ("sums",),
    )
    add("manifest-format-1", edit_manifest(set_path(("format_version",), lambda v: 1)), ("sums",))
    for label, content in {
        "empty": b"", "list": b"[]", "null": b"null", "string": b'"x"', "number": b"1",
        "deep": nested(100_000), "not-utf8": b'{"a": "\xff"}', "bom": b"\xef\xbb\xbf" + (pristine / MANIFEST_FILE).read_bytes(),
        "duplicate-keys": (pristine / MANIFEST_FILE).read_bytes().replace(b'"build_key"', b'"build_key": "x", "build_key"', 1),
        "huge": b" " * (2 << 20) + b"{}",
    }.items():  # fmt: skip
        add(f"manifest-whole-{label}", replace(MANIFEST_FILE, content), ("raw", "sums"))

    # SHA256SUMS
    sums = (pristine / SUMS_FILE).read_bytes()
    lines = sums.splitlines(keepends=True)
    report_line = f"{sha256_file(pristine / REPORT_FILE)}  {REPORT_FILE}\n".encode()
    for label, content in {
        "not-utf8": b"\xff" + sums, "empty": b"", "one-line": lines[0], "other-line": lines[1],
        "duplicate": sums + lines[0], "report-listed": sums + report_line, "uppercase": sums.upper(),
        "binary-marker": sums.replace(b"  ", b" *"), "crlf": sums.replace(b"\n", b"\r\n"),
        "leading-space": b" " + sums, "wrong-digest": b"0" * 64 + lines[0][64:] + lines[1],
        "path-prefix": sums.replace(b"  c", b"  ./c"), "absolute": sums.replace(b"  c", b"  /etc/c"),
        "huge": sums + b"#" * 10_000, "nul": sums + b"\0",
    }.items():  # fmt: skip
        add(f"sums-{label}", replace(SUMS_FILE, content), ("raw",))

    # the folder
    for name in (CACHE_FILE, MANIFEST_FILE, SUMS_FILE, REPORT_FILE):
        add(f"missing-{name}", remove(name), ("raw",))
        add(f"dir-instead-{name}", dir_instead(name), ("raw",))
    for name in (CACHE_FILE, MANIFEST_FILE, SUMS_FILE):
        add(f"symlink-{name}", symlink_to_copy(name), ("raw",))
        add(f"fifo-{name}", fifo_instead(name), ("raw",))
    for extra in ("notes.txt", ".hidden", "cache.safetensors.bak", "SHA256SUMS.asc"):
        add(f"extra-file-{extra}", add_file(extra), ("raw",))
    add("extra-dir", lambda b: (b / "sub").mkdir(), ("raw",))
    add("report-garbage", replace(REPORT_FILE, b"\xff\xfe not json"), ("raw",))
    return cases


# --- signatures (issue 18): every case is refused given the trusted key ---------------------------


def forge_cache(bundle: Path) -> None:
    """The issue's forged bundle: one K/V byte flipped mid-data, the manifest's cache.file_sha256,
    file_blake3 and file_bytes rewritten, SHA256SUMS regenerated (the signature left as it was)."""
    header, data = split_safetensors(bundle / CACHE_FILE)
    kv = min((v["data_offsets"] for k, v in header.items() if len(v.get("shape", ())) == 4))
    middle = len(data) - (kv[0] + kv[1]) // 2  # the middle of the first K/V tensor, from the end
    flip(CACHE_FILE, lambda n: n - middle, 0x10)(bundle)
    reseal_manifest(bundle)


def edit_signature(fn: Callable[[bytearray], None], line: int = 1) -> Mutation:
    """Decode one base64 line of the signature file (1: alg + key id + sig, 3: global), edit, re-encode."""

    def mutate(bundle: Path) -> None:
        lines = (bundle / SIGNATURE_FILE).read_bytes().split(b"\n")
        raw = bytearray(base64.b64decode(lines[line]))
        fn(raw)
        lines[line] = base64.b64encode(bytes(raw))
        (bundle / SIGNATURE_FILE).write_bytes(b"\n".join(lines))

    return mutate


def set_trusted_comment(text: str) -> Mutation:
    def mutate(bundle: Path) -> None:
        lines = (bundle / SIGNATURE_FILE).read_bytes().split(b"\n")
        lines[2] = b"trusted comment: " + text.encode()
        (bundle / SIGNATURE_FILE).write_bytes(b"\n".join(lines))

    return mutate


def xor_at(pos: int, mask: int = 0x01) -> Callable[[bytearray], None]:
    def edit(raw: bytearray) -> None:
        raw[pos] ^= mask

    return edit


def signature_corpus(signed: Path, key: SecretKey, other: SecretKey) -> list[Case]:
    """Mutations of a bundle signed by `key` (the trusted one); `other` is a key nobody trusts."""
    manifest = (signed / MANIFEST_FILE).read_bytes()
    sig = (signed / SIGNATURE_FILE).read_bytes()
    comment = sig.split(b"\n")[2].decode().removeprefix("trusted comment: ")
    cases: list[Case] = []
    add = lambda name, fn: cases.append(Case(name, fn, ("raw",)))  # noqa: E731
    for pos in (0, 1, 2, 9, 10, 40, 73):  # algorithm, key id, signature bytes
        add(f"sig-byte-{pos}", edit_signature(xor_at(pos)))
    for pos in (0, 31, 63):
        add(f"sig-global-byte-{pos}", edit_signature(xor_at(pos), line=3))
    add("sig-legacy-alg", edit_signature(lambda r: r.__setitem__(slice(0, 2), b"Ed")))
    add("sig-unknown-alg", edit_signature(lambda r: r.__setitem__(slice(0, 2), b"XX")))
    add("sig-wrong-key-id", edit_signature(lambda r: r.__setitem__(slice(2, 10), other.key_id)))
    for pos in (0, len(comment) // 2, len(comment) - 1):
        changed = comment[:pos] + chr(ord(comment[pos]) ^ 1) + comment[pos + 1 :]
        add(f"trusted-comment-char-{pos}", set_trusted_comment(changed))
    add("trusted-comment-other-version", set_trusted_comment(comment.replace("@1 ", "@2 ")))
    add("trusted-comment-empty", set_trusted_comment(""))
    other_bundle = manifest.replace(b'"version": 1', b'"version": 2', 1)
    add(
        "sig-of-another-bundle",
        replace(SIGNATURE_FILE, key.sign(other_bundle, comment).file_bytes()),
    )
    other_comment = key.sign(manifest, comment.replace("shop@1", "other@1"))
    add("sig-with-another-bundles-comment", replace(SIGNATURE_FILE, other_comment.file_bytes()))
    add("sig-by-untrusted-key", replace(SIGNATURE_FILE, other.sign(manifest, comment).file_bytes()))
    add("sig-line-swapped", lambda b: (b / SIGNATURE_FILE).write_bytes(b"\n".join(reversed(sig.split(b"\n")))))  # fmt: skip
    for label, keep in {"empty": 0, "one-line": sig.index(b"\n") + 1, "mid-sig": len(sig) // 3,
                        "no-global": sig.rindex(b"\n", 0, -1) + 1, "minus-2": len(sig) - 2}.items():  # fmt: skip
        add(f"sig-truncated-{label}", truncate(SIGNATURE_FILE, lambda n, k=keep: k))
    add("sig-appended-line", append(SIGNATURE_FILE, b"untrusted comment: more\n"))
    add("sig-not-utf8", replace(SIGNATURE_FILE, b"\xff" + sig))
    add("sig-huge", replace(SIGNATURE_FILE, sig + b"#" * 20_000))
    add("sig-missing", remove(SIGNATURE_FILE))
    add("sig-symlink", symlink_to_copy(SIGNATURE_FILE))
    add("sig-fifo", fifo_instead(SIGNATURE_FILE))
    add("sig-dir", dir_instead(SIGNATURE_FILE))
    for extra in ("manifest.json.minisig.bak", "cache.safetensors.minisig", "SHA256SUMS.minisig"):
        add(f"sig-extra-file-{extra}", add_file(extra, sig))
    add("forged-cache", forge_cache)
    add("forged-cache-signed-by-untrusted-key", lambda b: (forge_cache(b), _resign(b, other)))
    add("manifest-edited-sums-resealed", lambda b: (edit_manifest(set_path(("prefix", "version"), lambda v: 2))(b), reseal_sums(b)))  # fmt: skip
    return cases


def _resign(bundle: Path, key: SecretKey) -> None:
    """Sign the bundle's manifest as it now is, with `key` (an attacker's own key)."""
    comment = (bundle / SIGNATURE_FILE).read_bytes().split(b"\n")[2].decode()[17:]
    signature = key.sign((bundle / MANIFEST_FILE).read_bytes(), comment)
    (bundle / SIGNATURE_FILE).write_bytes(signature.file_bytes())
