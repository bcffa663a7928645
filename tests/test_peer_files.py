"""Files a command reads from folders it did not write are opened as the validator opens them
(issue 48, finding 5): a FIFO, a link to a device or an oversized manifest.json in a peer bundle
folder is skipped for block reuse with one line (pull), refused in one line (push), never waited
on or read without end."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from registry_env import Registry, registry
from test_oci import no_docker_config  # noqa: F401 - autouse: no credentials of this machine

from pipeline.cli import main
from pipeline.format.bundle_folder import CACHE_FILE, MANIFEST_FILE

PATIENCE_S = 15.0  # far beyond what a pull of the tiny bundle takes


@pytest.fixture
def reg(tmp_path: Path) -> Iterator[Registry]:
    with registry(tmp_path / "registry") as r:
        yield r


@contextmanager
def released(fifos: list[Path]) -> Iterator[None]:
    """Past PATIENCE_S, write to each FIFO a reader waits on, so that a command that blocked on
    one goes on (and its test fails on the time taken) instead of hanging the test run."""
    done = threading.Event()

    def release() -> None:
        if done.wait(PATIENCE_S):
            return
        while not done.is_set():
            for fifo in fifos:
                try:  # opens only while a reader is there (ENXIO otherwise)
                    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                except OSError:
                    continue
                os.write(fd, b"{}")
                os.close(fd)
            time.sleep(0.05)

    watchdog = threading.Thread(target=release, daemon=True)
    watchdog.start()
    try:
        yield
    finally:
        done.set()
        watchdog.join()


def fifo_file(path: Path) -> list[Path]:
    path.unlink()
    os.mkfifo(path)
    return [path]


def linked_to_dev_zero(path: Path) -> list[Path]:
    path.unlink()
    path.symlink_to("/dev/zero")
    return []


def oversized(path: Path) -> list[Path]:
    path.write_bytes(b" " * (2 << 20))
    return []


CASES = {  # file replaced -> (how, what the one line says)
    "fifo manifest": (MANIFEST_FILE, fifo_file, "manifest.json is a FIFO, not a regular file"),
    "dev zero link": (
        MANIFEST_FILE,
        linked_to_dev_zero,
        "manifest.json is a symlink (links are not followed)",
    ),  # fmt: skip
    "huge manifest": (
        MANIFEST_FILE,
        oversized,
        "manifest.json is 2,097,152 bytes, over the 1,048,576-byte limit",
    ),  # fmt: skip
    "fifo cache": (CACHE_FILE, fifo_file, "cache.safetensors is a FIFO, not a regular file"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pull_skips_a_peer_folder_it_cannot_read_for_reuse_with_one_line(
    case: str, reg: Registry, shop_bundle: Path, tmp_path: Path, tiny_model: Path, capsys
):
    """A half-copied folder of another prefix beside the pull's target: its blocks are not
    reused, one note says why, and the pull downloads instead (never waits on it)."""
    name, make, says = CASES[case]
    model = Path(shutil.copytree(tiny_model, tmp_path / "deploy" / "tiny"))
    peer = model / "prefix-bundles" / "other" / "1" / shop_bundle.name
    shutil.copytree(shop_bundle, peer)
    fifos = make(peer / name)
    assert main(["push", str(shop_bundle), "--repo", reg.repo()]) == 0
    capsys.readouterr()
    start = time.monotonic()
    with released(fifos):
        code = main(["pull", "--repo", reg.repo(), "--model", str(model)])
    seconds = time.monotonic() - start
    err = capsys.readouterr().err
    assert (code, seconds < PATIENCE_S) == (0, True), err
    assert err == f"note: not reused for blocks: {peer}: {says}\n"
    assert (
        model / "prefix-bundles" / "shop" / "1" / shop_bundle.name / CACHE_FILE
    ).read_bytes() == (shop_bundle / CACHE_FILE).read_bytes()


@pytest.mark.parametrize("case", ["fifo manifest", "dev zero link", "huge manifest"])
def test_push_refuses_a_bundle_whose_manifest_is_not_a_regular_file_in_one_line(
    case: str, reg: Registry, shop_bundle: Path, tmp_path: Path, capsys
):
    name, make, says = CASES[case]
    bundle = tmp_path / "bundles" / "shop" / "1" / shop_bundle.name
    shutil.copytree(shop_bundle, bundle)
    fifos = make(bundle / name)
    start = time.monotonic()
    with released(fifos):
        code = main(["push", str(bundle), "--repo", reg.repo()])
    seconds = time.monotonic() - start
    err = capsys.readouterr().err
    assert (code, seconds < PATIENCE_S) == (1, True), err
    assert err == f"error: bundle {bundle}: {says} (nothing was pushed to {reg.repo()})\n"
    assert not (reg.storage / "docker/registry/v2/repositories/fleet/bundles").exists()


def test_a_fifo_as_the_docker_config_is_one_line_never_waited_on(tmp_path: Path, monkeypatch):
    from pipeline.distribute import oci_auth
    from pipeline.format.errors import PipelineError

    folder = tmp_path / "docker"
    folder.mkdir()
    os.mkfifo(folder / "config.json")
    monkeypatch.setenv("DOCKER_CONFIG", str(folder))
    start = time.monotonic()
    with released([folder / "config.json"]), pytest.raises(PipelineError) as raised:
        oci_auth.credentials("reg.example")
    assert time.monotonic() - start < PATIENCE_S
    assert str(raised.value) == (
        f"{folder / 'config.json'}: cannot be read as a Docker config file (is a FIFO, not a "
        "regular file); fix or remove it, or set PREFIX_BUNDLES_REGISTRY_USER and "
        "PREFIX_BUNDLES_REGISTRY_PASSWORD"
    )
