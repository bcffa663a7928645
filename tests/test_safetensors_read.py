"""The single-pass reader: same arrays as mx.load, the file's sha256, and refusal of odd layouts."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import mlx.core as mx
import pytest
from blake3 import blake3

from pipeline.format.safetensors_read import FormatError, open_file, read_data, read_header


@pytest.fixture
def tensors_file(tmp_path: Path) -> Path:
    path = tmp_path / "t.safetensors"
    arrays = {
        "b": mx.arange(3000).astype(mx.bfloat16).reshape(10, 300),
        "a": mx.ones((7, 3), dtype=mx.float32),
        "q": mx.array([1, 2, 3], dtype=mx.uint32),
        "s": mx.array(5),
        "empty": mx.array([]),
    }
    mx.save_safetensors(str(path), arrays, {"note": "x"})
    return path


def read_all(path: Path, load: bool = True):
    header = read_header(path)
    return header, read_data(path, header, digests=("sha256", "blake3"), load=load)


def test_reads_what_mx_load_reads_and_hashes_the_file(tensors_file: Path):
    header, data = read_all(tensors_file)
    expected, expected_meta = mx.load(str(tensors_file), return_metadata=True)
    assert header.metadata == expected_meta == {"note": "x"}
    assert sorted(data.arrays) == sorted(expected)
    for name, value in expected.items():
        assert data.arrays[name].dtype == value.dtype and data.arrays[name].shape == value.shape
        assert mx.array_equal(data.arrays[name], value).item()
    raw = tensors_file.read_bytes()
    assert data.digests == {
        "sha256": hashlib.sha256(raw).hexdigest(),
        "blake3": blake3(raw).hexdigest(),
    }
    assert struct.unpack("<i", data.small["s"])[0] == 5


def test_hash_only_pass_keeps_scalars_and_loads_nothing(tensors_file: Path):
    _, data = read_all(tensors_file, load=False)
    assert data.arrays == {} and struct.unpack("<i", data.small["s"])[0] == 5
    assert data.digests["sha256"] == hashlib.sha256(tensors_file.read_bytes()).hexdigest()


def test_a_file_of_many_chunks_hashes_right_through_reused_buffers(tmp_path: Path):
    """The hash-only pass reads into a few buffers it reuses once both digests took them: every
    byte of a file many times their size hashed once, in order, by each."""
    import numpy as np

    from pipeline.format.safetensors_read import CHUNK

    path = tmp_path / "big.safetensors"
    rng = np.random.default_rng(7)
    arrays = {
        f"t{i}": mx.array(rng.integers(0, 255, CHUNK + 977 * i, dtype=np.uint8)) for i in range(5)
    }
    mx.save_safetensors(str(path), {**arrays, "s": mx.array(9)})
    _, data = read_all(path, load=False)
    raw = path.read_bytes()
    assert data.digests == {
        "sha256": hashlib.sha256(raw).hexdigest(),
        "blake3": blake3(raw).hexdigest(),
    }
    assert struct.unpack("<i", data.small["s"])[0] == 9


def test_nothing_to_hash_or_load_reads_only_the_scalars(tensors_file: Path, monkeypatch):
    """A file the hash memo vouches for, not loaded: its scalars are read, nothing else (it was
    read through, every byte, for nothing)."""
    from pipeline.format import safetensors_read

    monkeypatch.setattr(safetensors_read, "_stream_tensors", lambda *a: pytest.fail("read through"))
    header = read_header(tensors_file)
    data = read_data(tensors_file, header, digests=(), load=False)
    assert data.digests == {} and data.arrays == {}
    assert struct.unpack("<i", data.small["s"])[0] == 5 and set(data.small) == {"s", "empty"}


def test_a_changed_byte_changes_the_digest(tensors_file: Path):
    before = read_all(tensors_file)[1].digests
    data = bytearray(tensors_file.read_bytes())
    data[-20] ^= 0xFF
    tensors_file.write_bytes(bytes(data))
    after = read_all(tensors_file)[1].digests
    assert after["sha256"] != before["sha256"] and after["blake3"] != before["blake3"]


def test_truncated_file_is_refused(tensors_file: Path):
    tensors_file.write_bytes(tensors_file.read_bytes()[:-10])
    with pytest.raises(FormatError, match="file not fully covered"):
        read_header(tensors_file)


def test_file_changed_after_the_header_was_read_is_refused(tensors_file: Path):
    header = read_header(tensors_file)
    raw = bytearray(tensors_file.read_bytes())
    raw[10] = ord(" ") if raw[10] != ord(" ") else ord("\t")
    tensors_file.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="header changed"):
        read_data(tensors_file, header, digests=("sha256",), load=False)


def test_overlapping_tensors_are_refused(tmp_path: Path):
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    raw = json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(12))
    with pytest.raises(FormatError):
        read_header(path)


def test_not_safetensors_is_refused(tmp_path: Path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\xff" * 20)
    with pytest.raises(FormatError):
        read_header(path)


def test_bytes_appended_after_the_header_was_read_are_refused(tensors_file: Path):
    header = read_header(tensors_file)
    with open(tensors_file, "ab") as fh:
        fh.write(b"\0" * 16)
    for load in (False, True):
        with pytest.raises(FormatError, match="past its last tensor"):
            read_data(tensors_file, header, digests=("blake3",), load=load)


@pytest.mark.parametrize("swap", ["other data", "other layout"])
def test_a_file_swapped_in_just_before_the_load_changes_nothing(
    tensors_file: Path, monkeypatch, swap
):
    """The file is opened once and every step reads that open file: a rename landing between
    the header check and the load does not reach the load (issue 16, finding 3)."""
    pristine = read_data(tensors_file, read_header(tensors_file), digests=("blake3",), load=True)
    other = tensors_file.with_name("other.safetensors")
    if swap == "other data":
        raw = bytearray(tensors_file.read_bytes())
        raw[-20] ^= 0xFF  # same header, one data byte changed
        other.write_bytes(bytes(raw))
    else:
        mx.save_safetensors(str(other), {"b": mx.zeros((10, 300), dtype=mx.float32)})
    real_load = mx.load

    def swapped_load(path, *args, **kwargs):
        other.replace(tensors_file)
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(mx, "load", swapped_load)
    with open_file(tensors_file) as opened:
        header = read_header(opened)
        data = read_data(opened, header, digests=("blake3",), load=True)
    assert not other.exists()  # the swap happened, during the load
    assert data.digests == pristine.digests
    assert sorted(data.arrays) == sorted(pristine.arrays)
    for name, array in data.arrays.items():
        assert mx.array_equal(array, pristine.arrays[name]).item()


def test_open_file_refuses_links_and_fifos_without_blocking(tensors_file: Path, tmp_path: Path):
    import os

    link = tmp_path / "link.safetensors"
    link.symlink_to(tensors_file)
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    for path, says in ((link, "cannot be opened"), (fifo, "is not a regular file")):
        with pytest.raises(FormatError, match=says):
            with open_file(path):
                pass
