"""The restart memo vouches only for the bytes that are loaded (issue 16, finding 3).

`mount` on a restart skips hashing a cache file the memo knows by its stat. The stat, the header,
the load and any hash must all be of one open file: a thread swapping the bundle folder for one
with the same manifest and other data, while mounts run, must never get altered arrays through.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from pipeline.format.bundle_folder import CACHE_FILE
from pipeline.format.errors import BundleError
from pipeline.format.validate import validate
from pipeline.runtime.mount import identity_for

MOUNTS = 300


def swap(a: Path, b: Path) -> None:
    """Exchange two folders in one step (renameat2 RENAME_EXCHANGE; three renames elsewhere)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
        if libc.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), 2) == 0:
            return
    os.rename(a, a.with_name("swap-tmp"))
    os.rename(b, a)
    os.rename(a.with_name("swap-tmp"), b)


def arrays(cache: list) -> list[bytes]:
    return [np.array(x).tobytes() for layer in cache for x in layer.state]


def altered_copy(bundle: Path, dest: Path) -> Path:
    """The same manifest and SHA256SUMS, other K/V bytes (same size)."""
    shutil.copytree(bundle, dest)
    data = bytearray((dest / CACHE_FILE).read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # first tensor's data
    for i in range(start + 64, start + 96):
        data[i] ^= 0x40
    (dest / CACHE_FILE).write_bytes(bytes(data))
    return dest


def test_mounts_never_return_swapped_in_data(
    tmp_path: Path, shop_bundle: Path, tiny_model: Path, monkeypatch
):
    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "memo"))
    good = tmp_path / "bundles" / "shop" / "1" / shop_bundle.name
    shutil.copytree(shop_bundle, good)
    bad = altered_copy(shop_bundle, tmp_path / "bundles" / "shop" / "1" / "elsewhere")
    identity = identity_for(tiny_model)
    want = arrays(validate(good, identity, load=True, trust_memo=True).cache)  # memo learns it
    with pytest.raises(BundleError, match="mismatch"):
        validate(bad, identity, load=True, trust_memo=True)
    stop, swaps = threading.Event(), [0]

    def swapper() -> None:
        while not stop.is_set():
            swap(good, bad)
            swaps[0] += 1

    thread = threading.Thread(target=swapper, daemon=True)
    thread.start()
    results = {"right": 0, "wrong": 0, "refused": 0}
    try:
        for _ in range(MOUNTS):
            try:
                got = arrays(validate(good, identity, load=True, trust_memo=True).cache)
            except BundleError:
                results["refused"] += 1
                continue
            results["right" if got == want else "wrong"] += 1
    finally:
        stop.set()
        thread.join()
    assert swaps[0] > MOUNTS and results["wrong"] == 0, results
    assert results["right"] > 0 and results["refused"] > 0, results  # both folders were seen


def test_an_in_place_edit_during_a_memo_trusted_load_is_refused(
    tmp_path: Path, shop_bundle: Path, tiny_model: Path, monkeypatch
):
    """The memo's key is the open file's fstat before the read; a write to that same file while
    it loads (same inode, new ctime) must not pass as the hashed file."""
    import mlx.core as mx

    monkeypatch.setenv("PREFIX_BUNDLES_CACHE_DIR", str(tmp_path / "memo"))
    good = tmp_path / "bundles" / "shop" / "1" / shop_bundle.name
    shutil.copytree(shop_bundle, good)
    identity = identity_for(tiny_model)
    validate(good, identity, load=True, trust_memo=True)  # the memo learns the file
    data = (good / CACHE_FILE).read_bytes()
    offset = 8 + int.from_bytes(data[:8], "little") + 64
    real_load = mx.load

    def edit_then_load(path, *args, **kwargs):
        with open(good / CACHE_FILE, "r+b") as fh:
            fh.seek(offset)
            fh.write(bytes([data[offset] ^ 0x40]))
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(mx, "load", edit_then_load)
    with pytest.raises(BundleError, match="changed while it was being read; mount again"):
        validate(good, identity, load=True, trust_memo=True)
