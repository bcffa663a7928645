"""The single-pass reader: same arrays as mx.load, the file's sha256, and refusal of odd layouts."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import mlx.core as mx
import pytest

from pipeline.format.safetensors_read import FormatError, read_verified


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


def test_reads_what_mx_load_reads_and_hashes_the_file(tensors_file: Path):
    arrays, metadata, digest = read_verified(tensors_file)
    expected, expected_meta = mx.load(str(tensors_file), return_metadata=True)
    assert metadata == expected_meta == {"note": "x"}
    assert sorted(arrays) == sorted(expected)
    for name, value in expected.items():
        assert arrays[name].dtype == value.dtype and arrays[name].shape == value.shape
        assert mx.array_equal(arrays[name], value).item()
    assert digest == hashlib.sha256(tensors_file.read_bytes()).hexdigest()


def test_a_changed_byte_changes_the_digest(tensors_file: Path):
    before = read_verified(tensors_file)[2]
    data = bytearray(tensors_file.read_bytes())
    data[-20] ^= 0xFF
    tensors_file.write_bytes(bytes(data))
    assert read_verified(tensors_file)[2] != before


def test_truncated_file_is_refused(tensors_file: Path):
    tensors_file.write_bytes(tensors_file.read_bytes()[:-10])
    with pytest.raises(FormatError, match="file is .* bytes but its tensors end at"):
        read_verified(tensors_file)


def test_overlapping_tensors_are_refused(tmp_path: Path):
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    raw = json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(12))
    with pytest.raises(FormatError, match="does not follow the previous one"):
        read_verified(path)


def test_not_safetensors_is_refused(tmp_path: Path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\xff" * 20)
    with pytest.raises(FormatError, match="header length"):
        read_verified(path)
