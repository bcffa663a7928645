"""Remount is consistent (issue 37): a new version that is refused or that the server's options
cannot use keeps the mounted one, every refusal is a WARNING, and the report names every prefix
with the bundle it serves and why."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from fuzz_corpus import reseal_sums
from test_incremental import MORE, define, run_build

from pipeline.runtime import mount
from pipeline.runtime.prompt_cache import PromptCacheManager
from pipeline.runtime.remount import Remounter

from conftest import SYSTEM


def remounter(root: Path, model: Path, unusable) -> tuple[Remounter, PromptCacheManager]:
    manager = PromptCacheManager()
    first = mount(model, root / "bundles", skip_refused=True, manager=manager, model_key="m")

    def load():
        return mount(model, root / "bundles", skip_refused=True)

    return Remounter(first, manager, "m", load, unusable), manager


def test_an_unusable_new_version_keeps_the_mounted_one_like_a_refused_one(
    tmp_path: Path, tiny_model: Path, caplog
):
    root = tmp_path / "project"
    define(root, tiny_model)
    v1 = run_build(root)
    r, manager = remounter(
        root, tiny_model, lambda b: "4-bit: not usable" if b.name == "shop@2" else None
    )
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    v2 = run_build(root)
    with caplog.at_level(logging.INFO, logger="prefix-bundles"):
        changes = r.remount()
        changes.log(logging.getLogger("prefix-bundles"))
    assert changes.removed == [] and changes.kept == ["shop@1"]
    assert changes.unused == [(v2.bundle, "4-bit: not usable")]
    assert changes.serving == [("shop@1", "its new version was refused or is not usable")]
    assert [b.name for b in r.current.values()] == ["shop@1"]
    (mounted,) = r.current.values()
    assert mounted.path == v1.bundle
    assert manager.covered("m", [*mounted.tokens, 1]) == len(mounted.tokens)  # still pinned
    warning = [rec for rec in caplog.records if "not used" in rec.getMessage()]
    assert warning and warning[0].levelno == logging.WARNING


def test_a_refused_new_version_is_a_warning_and_the_old_one_is_kept(
    tmp_path: Path, tiny_model: Path, caplog
):
    root = tmp_path / "project"
    define(root, tiny_model)
    run_build(root)
    r, _ = remounter(root, tiny_model, lambda b: None)
    define(root, tiny_model, version=2, system=SYSTEM + MORE)
    v2 = run_build(root)
    (v2.bundle / "cache.safetensors").write_bytes(b"truncated")
    with caplog.at_level(logging.INFO, logger="prefix-bundles"):
        r.remount().log(logging.getLogger("prefix-bundles"))
    refused = [rec for rec in caplog.records if "remount: refused" in rec.getMessage()]
    assert refused and refused[0].levelno == logging.WARNING
    assert [b.name for b in r.current.values()] == ["shop@1"]


def test_the_admin_endpoint_stops_serve_gracefully_only_with_the_token():
    """POST /v1/stop answers 202 and begins the stop (serve's: SIGTERM to its own process, or
    from a spawned model process to serve's); without the token nothing happens; without a stop
    to offer the route does not exist."""
    import json
    import socket
    import time
    import urllib.error
    import urllib.request
    from types import SimpleNamespace

    from pipeline.runtime.admin import start_admin

    def post(port: int, token: str | None) -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/stop", data=b"", method="POST", headers=headers
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def free() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    stops: list[bool] = []
    port = free()
    httpd = start_admin(port, "t0ken-0123456789", SimpleNamespace(), lambda: stops.append(True))
    try:
        assert post(port, None)[0] == 401 and stops == []
        assert post(port, "t0ken-0123456789") == (202, {"stopping": True})
        deadline = time.monotonic() + 10  # the stop begins once the answer has gone out
        while not stops and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stops == [True]
    finally:
        httpd.shutdown()
    port = free()
    httpd = start_admin(port, None, SimpleNamespace())
    try:
        status, body = post(port, None)
        assert status == 404 and "POST /v1/stop" not in body["error"]
    finally:
        httpd.shutdown()


def test_what_a_remount_pins_is_what_the_mount_result_lists(tmp_path: Path, tiny_model: Path):
    """The rest of the process reads the mount result (a changed model folder unpins every
    bundle it lists; snapshots name the bundle an entry continued from): a remount's additions
    and removals show there (before: only the startup bundles; outside review)."""
    root = tmp_path / "project"
    define(root, tiny_model)
    run_build(root)
    manager = PromptCacheManager()
    first = mount(tiny_model, root / "bundles", skip_refused=True, manager=manager, model_key="m")
    r = Remounter(
        first, manager, "m", lambda: mount(tiny_model, root / "bundles", skip_refused=True)
    )
    define(root, tiny_model, name="other", system=SYSTEM + MORE)
    run_build(root, "other")
    assert r.remount().added == ["other@1"]
    assert sorted(b.name for b in first.bundles) == ["other@1", "shop@1"]
    for b in list(first.bundles):
        manager.unpin("m", b.name)
    assert manager.stats()["pinned"] == 0  # nothing pinned the result does not list
    shutil.rmtree(root / "bundles" / "other")
    r.remount()
    assert [b.name for b in first.bundles] == ["shop@1"]


def test_every_remount_runs_on_one_worker_thread_and_a_burst_is_one_remount(
    tmp_path: Path, tiny_model: Path
):
    """MLX keeps a stream thread for each thread that evaluates arrays: a thread per remount
    (SIGHUP, each admin request) grew the process by one OS thread per remount. All run on one
    worker; requests made while one waits to start join it."""
    import os
    import threading

    root = tmp_path / "project"
    define(root, tiny_model)
    run_build(root)
    r, _ = remounter(root, tiny_model, lambda b: None)
    calls, gate = [], threading.Event()
    load = r.load

    def counted():
        calls.append(threading.current_thread().name)
        gate.wait(10)
        return load()

    r.load = counted

    def os_threads() -> int:
        return len(os.listdir("/proc/self/task"))

    first = r.request()
    while not calls:  # the first is under way; the next ones wait, and join one another
        threading.Event().wait(0.01)
    burst = [r.request() for _ in range(50)]
    assert len({id(f) for f in burst}) == 1
    gate.set()
    first.result(10), burst[0].result(10)
    assert calls == ["prefix-bundles-remount"] * 2
    before = os_threads()
    for _ in range(20):
        threading.Thread(target=r.remount).start()  # as the admin endpoint's request threads
    for _ in range(20):
        r.remount()
    assert os_threads() <= before + 2, (before, os_threads())  # no thread left per remount


def test_a_remount_while_the_bundles_folder_is_away_changes_nothing(
    tmp_path: Path, tiny_model: Path
):
    """A deploy's `mv bundles bundles.old; mv new bundles` caught half-way: the remount fails as
    a whole (SIGHUP logs it, the admin endpoint answers 500) and what was mounted stays (before:
    every bundle was removed and the remount answered 200)."""
    import pytest

    from pipeline.format.errors import PipelineError
    from pipeline.format.served_identity import settled_identity
    from pipeline.runtime.servers.options import ServeOptions
    from pipeline.runtime.servers.startup import mount_options, remount_read

    root = tmp_path / "project"
    define(root, tiny_model)
    run_build(root)
    options = ServeOptions("mlx-lm", tiny_model, root / "bundles", (), (), True)
    served = settled_identity(tiny_model)
    read = remount_read(options, mount_options(options, None, served[0].model), served)
    manager = PromptCacheManager()
    first = mount(tiny_model, root / "bundles", skip_refused=True, manager=manager, model_key="m")
    r = Remounter(first, manager, "m", read)
    (root / "bundles").rename(root / "bundles.old")
    with pytest.raises(PipelineError, match="is not a folder now; nothing was changed"):
        r.remount()
    assert [b.name for b in r.current.values()] == ["shop@1"] == [b.name for b in first.bundles]


def test_a_new_version_with_the_same_bytes_is_served_under_its_own_name(
    tmp_path: Path, tiny_model: Path
):
    """shop@2 whose cache bytes equal shop@1's (a version bump with no change to the tokens):
    the remount kept listing shop@1 at a folder that had been deleted. Now shop@2 replaces it."""
    root = tmp_path / "project"
    define(root, tiny_model)
    v1 = run_build(root)
    r, _ = remounter(root, tiny_model, lambda b: None)
    v2 = root / "bundles" / "shop" / "2" / v1.bundle.name
    shutil.copytree(v1.bundle, v2)
    manifest = json.loads((v2 / "manifest.json").read_text())
    manifest["prefix"]["version"] = 2
    (v2 / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    reseal_sums(v2)
    shutil.rmtree(v1.bundle.parent.parent / "1")
    changes = r.remount()
    assert changes.replaced == [("shop@1", "shop@2")], changes
    assert [(b.name, b.path) for b in r.current.values()] == [("shop@2", v2)]
