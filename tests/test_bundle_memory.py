"""serve --bundle-memory: bundles past the budget wait on disk, validated at mount without their
tensors, and are read back through the one validator on a hit, the least recently hit moved
back to disk; a file deleted, truncated or replaced under the server is served without (one
line, never a wrong answer, never a traceback); a budget smaller than one bundle reads it from
disk at every hit."""

from __future__ import annotations

import dataclasses
import gc
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
import servers_env
from test_prompt_cache_shared import PREAMBLE, TAILS, define, same_cache, tenants  # noqa: F401

from pipeline.format.bundle_folder import CACHE_FILE
from pipeline.format.errors import PipelineError
from pipeline.runtime import PromptCacheManager, mount

from conftest import build_bundle

ROOT = Path(__file__).resolve().parents[1]


def copy_of(bundles: Path, tmp_path: Path) -> Path:
    """A copy of the bundles folder this test may damage."""
    return Path(shutil.copytree(bundles, tmp_path / "bundles"))


def alone(model: Path, path: Path, request: list[int]):
    manager = PromptCacheManager()
    mount(model, [path], manager=manager, model_key="m")
    return manager.fetch("m", request)


def test_bundles_past_the_budget_wait_on_disk_and_are_read_on_a_hit(
    tenants: Path,  # noqa: F811
    tiny_model: Path,
    caplog: pytest.LogCaptureFixture,
):
    caplog.set_level(logging.INFO, logger="prefix-bundles")
    sizes = {b.name: b.manifest.cache.nbytes for b in mount(tiny_model, tenants).bundles}
    budget = max(sizes.values())  # one bundle whole
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    manager = PromptCacheManager(bundle_memory=budget)
    result = mount(tiny_model, tenants, manager=manager, model_key="m")
    stats = manager.stats()
    assert stats["pinned"] == 3 and stats["on_disk"] >= 1 and stats["held_bytes"] <= budget
    assert mx.get_active_memory() - before <= 1.2 * budget
    for _ in range(2):  # every bundle warm, each hit the hand-out of the bundle alone
        for b in reversed(result.bundles):
            request = b.tokens + [5, 6]
            hit = manager.fetch("m", request)
            assert hit.source == f"bundle:{b.name}" and hit.cache_hit_tokens == len(b.tokens)
            assert same_cache(hit.cache, alone(tiny_model, b.path, request).cache)
            assert manager.stats()["held_bytes"] <= budget
    stats = manager.stats()
    assert stats["disk_reads"] >= 2 and stats["disk_evictions"] >= 2
    assert stats["disk_read_failures"] == 0
    lines = [r.getMessage() for r in caplog.records]
    assert sum("read from disk in" in line for line in lines) == stats["disk_reads"]
    assert sum(": moved to disk (" in line for line in lines) == stats["disk_evictions"]


def damage(kind: str, bundle: Path, tmp_path: Path, model: Path) -> None:
    cache = bundle / CACHE_FILE
    if kind == "deleted":
        shutil.rmtree(bundle)
    elif kind == "truncated":
        cache.write_bytes(cache.read_bytes()[:-100])
    elif kind == "bytes replaced":
        data = bytearray(cache.read_bytes())
        data[-10] ^= 0x40
        cache.write_bytes(bytes(data))
    else:  # another valid bundle of the same name and version put in its place
        other = tmp_path / "other"
        define(other, model, "tenant-a", PREAMBLE + " Reseller A now ships to Iceland too.")
        rebuilt = build_bundle(other, "tenant-a")
        shutil.rmtree(bundle)
        shutil.copytree(rebuilt, bundle)


@pytest.mark.parametrize("kind", ["deleted", "truncated", "bytes replaced", "another bundle"])
def test_a_disk_bundle_damaged_while_serving_is_served_without_in_one_line(
    tenants: Path,  # noqa: F811
    tiny_model: Path,
    tmp_path: Path,
    kind: str,
    caplog: pytest.LogCaptureFixture,
):
    bundles = copy_of(tenants, tmp_path)
    manager = PromptCacheManager(bundle_memory=0)  # every bundle on disk
    result = mount(tiny_model, bundles, manager=manager, model_key="m")
    (victim,) = [b for b in result.bundles if b.name == "tenant-a@1"]
    damage(kind, victim.path, tmp_path, tiny_model)
    caplog.set_level(logging.INFO, logger="prefix-bundles")
    request = victim.tokens + [5, 6]
    hit = manager.fetch("m", request)  # never tenant-a's, never an exception
    assert hit.source != "bundle:tenant-a@1"
    if hit.cache is not None:  # another bundle serves what it covers, exactly
        (other,) = [b for b in result.bundles if hit.source == f"bundle:{b.name}"]
        assert same_cache(hit.cache, alone(tiny_model, other.path, request).cache)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "bundle tenant-a@1: cannot be read back from disk" in errors[0]
    assert "\n" not in errors[0] and "Traceback" not in caplog.text
    assert manager.stats()["disk_read_failures"] == 1
    manager.fetch("m", request)  # unmounted: not tried, not logged again
    assert manager.stats()["disk_read_failures"] == 1 and manager.stats()["pinned"] == 2


def test_a_budget_smaller_than_one_bundle_reads_it_from_disk_at_every_hit(
    tenants: Path,  # noqa: F811
    tiny_model: Path,
    caplog: pytest.LogCaptureFixture,
):
    caplog.set_level(logging.INFO, logger="prefix-bundles")
    manager = PromptCacheManager(bundle_memory=1024)
    result = mount(tiny_model, tenants, manager=manager, model_key="m")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 3 and all("is larger than --bundle-memory (0.0 MiB)" in w for w in warned)
    assert "give --bundle-memory at least" in warned[0]
    b = result.bundles[0]
    for n in (1, 2):
        hit = manager.fetch("m", b.tokens + [7])
        assert hit.cache_hit_tokens == len(b.tokens)  # warm, every time
        stats = manager.stats()
        assert stats["disk_reads"] == n and stats["resident"] == 0 and stats["held_bytes"] == 0


def test_bundle_memory_is_a_size(tiny_model: Path, capsys, monkeypatch: pytest.MonkeyPatch):
    from pipeline.cli import main
    from pipeline.runtime.servers import startup
    from pipeline.runtime.servers.options import bundle_memory

    assert bundle_memory(SimpleNamespace(bundle_memory="512MiB")) == 512 << 20
    assert bundle_memory(SimpleNamespace(bundle_memory=None)) is None
    with pytest.raises(PipelineError, match=r"^--bundle-memory '2 lots' is not a size"):
        bundle_memory(SimpleNamespace(bundle_memory="2 lots"))

    def mount_for(*args, **kwargs):
        raise AssertionError("mounted before the budget was checked")

    monkeypatch.setattr(startup, "mount_for", mount_for)
    assert main(["serve", "--model", str(tiny_model), "--bundle-memory", "2 lots"]) == 2
    assert capsys.readouterr().err.startswith("error: --bundle-memory '2 lots' is not a size;")


def chat(port: int, system: str, question: str) -> dict:
    """One greedy chat completion opening with `system`."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return servers_env.chat(port, {"messages": messages, "max_tokens": 8, "temperature": 0.0})[0]


@pytest.mark.slow
def test_serve_with_a_budget_for_one_bundle_serves_all_three_warm_and_equal_cold(
    tenants: Path,  # noqa: F811
    tiny_model: Path,
    tmp_path: Path,
):
    from test_serve import cached, server_process

    budget = max(b.manifest.cache.nbytes for b in mount(tiny_model, tenants).bundles)
    systems = {"shop@1": PREAMBLE, **{f"{n}@1": PREAMBLE + t for n, t in TAILS.items()}}
    counts = {b.name: len(b.tokens) for b in mount(tiny_model, tenants).bundles}
    log = tmp_path / "warm.log"
    with server_process(tiny_model, tenants, log, "--bundle-memory", str(budget)) as (_, port):
        warm = {n: chat(port, s, "Where is my order 12345?") for n, s in systems.items()}
        again = {n: chat(port, s, "Where is my order 12345?") for n, s in systems.items()}
    text = log.read_text()
    assert "read from disk in" in text and "Traceback" not in text
    assert f"wait on disk (--bundle-memory {budget / 2**20:.1f} MiB)" in text
    empty = tmp_path / "none"
    empty.mkdir()
    with server_process(tiny_model, empty, tmp_path / "cold.log") as (_, port):
        cold = {n: chat(port, s, "Where is my order 12345?") for n, s in systems.items()}
    for name in systems:
        for answer in (warm[name], again[name]):
            assert cached(answer) >= counts[name] - 1, (name, answer["usage"])
            assert answer["choices"][0]["message"] == cold[name]["choices"][0]["message"]
            assert answer["usage"]["prompt_tokens"] == cold[name]["usage"]["prompt_tokens"]
    assert cached(cold["shop@1"]) == 0  # (later cold ones reuse the server's own entries)


def test_a_remount_shares_and_keeps_the_budget(
    tenants: Path,  # noqa: F811
    tiny_model: Path,
    tmp_path: Path,
):
    """A bundle a remount adds shares what is held and holds no cache of its own; under a
    budget it waits on disk when nothing else can make room, and is still served warm."""
    from pipeline.runtime.remount import Remounter

    bundles = copy_of(tenants, tmp_path)
    later = bundles / "tenant-b"
    shutil.move(later, tmp_path / "later")
    sizes = {b.name: b.manifest.cache.nbytes for b in mount(tiny_model, bundles).bundles}
    for budget in (None, sizes["shop@1"]):  # the preamble alone: the new tenant cannot fit
        if later.exists():
            shutil.move(later, tmp_path / "later")
        manager = PromptCacheManager(bundle_memory=budget)
        first = mount(tiny_model, bundles, manager=manager, model_key="m")
        r = Remounter(first, manager, "m", lambda: mount(tiny_model, bundles, skip_refused=True))
        shutil.move(tmp_path / "later", later)
        assert r.remount().added == ["tenant-b@1"]
        (added,) = [b for b in first.bundles if b.name == "tenant-b@1"]
        stats = manager.stats()
        assert added.cache == [] and stats["pinned"] == 3
        if budget is None:
            assert stats["held_bytes"] < 0.5 * stats["pinned_bytes"]
        else:
            assert stats["held_bytes"] <= budget
        request = added.tokens + [4]
        hit = manager.fetch("m", request)
        assert hit.source == "bundle:tenant-b@1" and hit.cache_hit_tokens == len(added.tokens)
        assert same_cache(hit.cache, alone(tiny_model, added.path, request).cache)


@pytest.mark.parametrize("remount", ["removed", "replaced"])
def test_a_disk_read_racing_a_remount_never_brings_back_what_it_replaced(
    tenants: Path,  # noqa: F811
    tiny_model: Path,
    remount: str,
    caplog: pytest.LogCaptureFixture,
):
    """A remount that removes or replaces a bundle while a request reads it back from disk wins:
    the read is not put back in its place (it would serve a withdrawn bundle, and fail at its next
    read from a folder that now holds another), and no line says a bundle was unmounted."""
    manager = PromptCacheManager(bundle_memory=0)  # every bundle on disk
    result = mount(tiny_model, tenants, manager=manager, model_key="m")
    (a,) = [b for b in result.bundles if b.name == "tenant-a@1"]
    (shop,) = [b for b in result.bundles if b.name == "shop@1"]

    def read_meanwhile_remounted() -> list:
        cache = a.read()  # the request's read finishes; the remount lands before it is kept
        if remount == "removed":
            manager.unpin("m", a.name)
        else:  # the folder now holds another bundle of this name: shop's cache stands for it
            manager.pin_on_disk(
                "m", shop.tokens, a.name, reload=shop.read, nbytes=shop.manifest.cache.nbytes,
                lossy=False,
            )  # fmt: skip
        return cache

    (key,) = [k for k, e in manager._pinned["m"].items() if k == a.name]
    manager._pinned["m"][key] = dataclasses.replace(
        manager._pinned["m"][key], reload=read_meanwhile_remounted
    )
    caplog.set_level(logging.INFO, logger="prefix-bundles")
    hit = manager.fetch("m", a.tokens + [5, 6])
    assert hit.source != "bundle:tenant-a@1" or remount == "replaced"
    if hit.cache is not None:
        assert hit.cache_hit_tokens < len(a.tokens)  # shop's opening, never tenant-a's K/V
    pinned = manager._pinned["m"]
    if remount == "removed":
        assert a.name not in pinned
    else:
        assert np.array_equal(pinned[a.name].tokens, shop.tokens)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
