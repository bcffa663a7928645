"""vllm-mlx --continuous-batching and rapid-mlx, each with `--use-paged-cache` (issue 52.4): the
bundles enter the engine's own paged prefix cache as its blocks (servers/paged_cache.py), as real
server processes over loopback HTTP. Two bundles sharing a preamble share its blocks (the
engine's own block stats), a conversation's next turn is served from the blocks its first turn
stored, and a remount that withdraws a bundle leaves none of its blocks served; every answer
equals a cold server's, every usage its lookup."""

from __future__ import annotations

import json
import re
import shutil
import urllib.request
from pathlib import Path

import pytest
from servers_env import ROOT, chat, free_port, rapid_python, running_together, servers_python
from test_servers_cache_kinds import remount

from pipeline.format.validate import validate
from pipeline.runtime.mount import identity_for

from conftest import SYSTEM, TOOLS, build_bundle, write_definition

BLOCK = 16  # tokens per block: the tiny bundles' shared preamble spans several
TAIL = " Tenant B: orders ship from the Leipzig store; returns within 30 days."
SERVERS = {  # name -> (python, the server's options)
    "vllm-mlx": (servers_python, ["--continuous-batching", "--use-paged-cache"]),
    "rapid-mlx": (rapid_python, ["--use-paged-cache"]),
}


def command(server: str, model: Path, bundles: Path, port: int, admin: int | None) -> list[str]:
    python, options = SERVERS[server]
    serve = [str(python()), str(ROOT / "build.py"), "--bundles", str(bundles), "serve"]
    serve += ["--server", server, "--model", str(model), "--port", str(port)]
    serve += ["--admin-port", str(admin)] if admin is not None else []
    return [*serve, *options, "--paged-cache-block-size", str(BLOCK)]


@pytest.mark.parametrize("server", list(SERVERS))
@pytest.mark.parametrize(
    ("serve_options", "why"),
    [({"bundle_memory": 1 << 20}, "with --bundle-memory: its blocks would hold every mounted")],
)
def test_what_the_paged_engines_cannot_honour_is_refused_with_one_line(
    server: str, serve_options: dict, why: str
):
    from pipeline.format.errors import PipelineError
    from pipeline.runtime.servers import hook_for
    from pipeline.runtime.servers.options import ServeOptions, refuse_options

    rest = SERVERS[server][1]
    options = ServeOptions(server, Path("m"), Path("b"), tuple(rest), (), True, **serve_options)
    with pytest.raises(PipelineError) as caught:
        refuse_options(rest, server, hook_for(server).refused(options))
    assert str(caught.value).startswith(
        f"serve --server {server}: --use-paged-cache is not supported: {why}"
    )
    plain = ServeOptions(server, Path("m"), Path("b"), tuple(rest), (), True)
    refuse_options(rest, server, hook_for(server).refused(plain))  # alone: served
    spilled = ServeOptions(server, Path("m"), Path("b"), tuple(rest), (), True, snapshots=Path("s"))
    refuse_options(rest, server, hook_for(server).refused(spilled))  # --snapshots: its entries


def question(model: Path, system: str, text: str, turns: list[dict] | None = None) -> dict:
    messages = [{"role": "system", "content": system}, *(turns or [])]
    return {
        "model": str(model),
        "messages": [*messages, {"role": "user", "content": text}],
        "tools": TOOLS,
        "max_tokens": 8,
        "temperature": 0.0,
    }


def blocks(port: int) -> dict:
    """The engine's own paged-cache stats (its /v1/status)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=30) as resp:
        return json.loads(resp.read())["cache"]


def tokens_of(bundle: Path, model: Path) -> list[int]:
    """A bundle's token ids, as the one validator reads them."""
    return validate(bundle, identity_for(model)).tokens


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("server", list(SERVERS))
def test_bundles_enter_the_paged_cache_as_blocks_shared_by_a_preamble(
    server: str, tiny_model: Path, tmp_path: Path
):
    write_definition(tmp_path, tiny_model)
    write_definition(tmp_path, tiny_model, name="tenant")
    toml = tmp_path / "prefixes" / "tenant.toml"
    toml.write_text(toml.read_text().replace(json.dumps(SYSTEM), json.dumps(SYSTEM + TAIL)))
    shop, tenant = build_bundle(tmp_path), build_bundle(tmp_path, "tenant")
    shop_ids, tenant_ids = tokens_of(shop, tiny_model), tokens_of(tenant, tiny_model)
    common = next(i for i, (a, b) in enumerate(zip(shop_ids, tenant_ids, strict=False)) if a != b)
    per_bundle = [-(-len(ids) // BLOCK) for ids in (shop_ids, tenant_ids)]
    shared = common // BLOCK
    assert shared >= 2  # the preamble spans whole blocks

    port, admin, cold_port, empty = free_port(), free_port(), free_port(), tmp_path / "none"
    empty.mkdir()
    log = tmp_path / "warm.log"
    warm_server = (command(server, tiny_model, tmp_path / "bundles", port, admin), port, log)
    cold_server = (command(server, tiny_model, empty, cold_port, None), cold_port, tmp_path / "c")
    first = [question(tiny_model, s, "Where is my order 12345?") for s in (SYSTEM, SYSTEM + TAIL)]
    with running_together([warm_server, cold_server], {"HOME": str(tmp_path / "home")}):
        warm = [chat(port, b)[0] for b in first]
        held = blocks(port)
        # the next turn of the first conversation: its own blocks (sharing the bundle's) serve it
        turn = [{"role": "user", "content": "Where is my order 12345?"}, warm[0]["choices"][0][
            "message"]]  # fmt: skip
        second = question(tiny_model, SYSTEM, "And order 777?", turn)
        warm.append(chat(port, second)[0])
        # tenant withdrawn (its bundle gone): none of its blocks serves its prompt any more
        shutil.rmtree(tmp_path / "bundles" / "tenant")
        assert remount(admin)["removed"] == ["tenant@1"]
        warm.append(chat(port, first[1])[0])
        cold = [chat(cold_port, b)[0] for b in [*first, second, first[1]]]
    text = log.read_text()
    assert "2 bundle(s) mounted, 0 refused" in text and "Traceback" not in text, text[-3000:]
    assert f"bundle shop@1 entered its paged cache as {per_bundle[0]} blocks (0 shared" in text
    assert (
        f"bundle tenant@1 entered its paged cache as {per_bundle[1]} blocks ({shared} shared"
        in text
    )
    # its own stats: the bundles' blocks (and its null block), the preamble's held once
    assert held["allocated_blocks"] - 1 >= sum(per_bundle) - shared, held
    assert held["shared_blocks"] >= shared, held
    assert [cached(a) for a in warm[:2]] == [len(shop_ids), len(tenant_ids)]
    own = re.findall(r"bundle shop@1 covers \d+ of (\d+) prompt tokens; the server's own cache "
                     r"covers (\d+), and is used", text)  # fmt: skip
    assert own and int(own[-1][1]) > len(shop_ids) and cached(warm[2]) == int(own[-1][1])
    assert "were withdrawn or replaced: the paged cache is cleared" in text
    assert cached(warm[3]) == common  # from shop@1 only: the preamble it shares, nothing of tenant
    # the cleared cache holds shop@1 again (and the last request's entry), tenant@1 never again
    assert text.count("bundle shop@1 entered its paged cache") == 2, text[-3000:]
    assert text.count("bundle tenant@1 entered its paged cache") == 1, text[-3000:]
    for i, (w, c) in enumerate(zip(warm, cold, strict=True)):
        assert w["choices"][0]["message"] == c["choices"][0]["message"], (server, i)
        assert w["usage"]["prompt_tokens"] == c["usage"]["prompt_tokens"], (server, i)


# The engines' own BlockAwarePrefixCache and PagedCacheManager (installed), block size 4, with
# synthetic K/V: A and B differ in their first block and agree in their second. vllm-mlx 0.6 keys a
# block by its own tokens, so storing B reuses A's second block (K/V computed after A's first
# block); rapid-mlx keys it by its history. serve's class stores no such entry and hands out only
# K/V of exactly the request's tokens.
ENGINE_CHECK = """
import json, sys
import mlx.core as mx
from pathlib import Path
from pipeline.runtime.mount import MountResult
from pipeline.runtime.prompt_cache import PromptCacheManager
from pipeline.runtime.servers.mounted import Mounted
from pipeline.runtime.servers.paged_cache import pinned_paged_cache_class
from mlx_lm.models.cache import KVCache

pkg = sys.argv[1]
paged = __import__(pkg + ".paged_cache", fromlist=["x"])
prefix = __import__(pkg + ".prefix_cache", fromlist=["x"])
mounted = Mounted(Path("model"), PromptCacheManager(), MountResult())
cls = pinned_paged_cache_class(mounted, prefix.BlockAwarePrefixCache, paged.BlockTable, pkg)

def kv(n, seed):
    layer = KVCache()
    keys = mx.random.normal((1, 2, n, 8), key=mx.random.key(seed))
    layer.update_and_fetch(keys, keys + 1)
    return [layer]

def states(cache):
    return [{"state": c.state, "meta_state": c.meta_state, "class_name": "KVCache",
             "class_ref": KVCache} for c in cache]

A, B = [1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 5, 6, 7, 8, 9]
kv_a, kv_b = kv(9, 0), kv(9, 1)
plain = prefix.BlockAwarePrefixCache(None, paged.PagedCacheManager(block_size=4, max_blocks=64))
plain.store_cache("a", A, states(kv_a))
plain.store_cache("b", B, states(kv_b))
tables = [plain.paged_cache.get_block_table(r).block_ids for r in ("a", "b")]
engine_reuses = tables[0][1] == tables[1][1]

ours = cls(None, paged.PagedCacheManager(block_size=4, max_blocks=64))
stored = []
for rid, ids, cache in (("a", A, kv_a), ("b", B, kv_b)):
    ours.fetch_cache(rid, ids)
    stored.append(ours.store_cache(rid, ids, states(cache)) is not None)
out = {"engine_reuses": engine_reuses, "stored": stored}
for rid, ids, want in (("ra", A[:8] + [20], kv_a), ("rb", B[:8] + [20], kv_b), ("x", A, kv_a)):
    table, rest = ours.fetch_cache(rid, ids)
    cache = ours.reconstruct_cache(table) if table is not None else None
    n = len(ids) - len(rest)
    right = cache is None or all(
        mx.array_equal(c.keys[..., :n, :], w.keys[..., :n, :]).item() and c.offset == n
        for c, w in zip(cache, want))
    out[rid] = [n, 0 if table is None else table.num_tokens, len(rest), right]

# a pinned bundle P enters as blocks at the first lookup and serves all its tokens; withdrawn, it
# clears the cache, and a request looked up before (in flight) stores nothing after
from types import SimpleNamespace as NS
from pipeline.runtime.servers.mounted import BUNDLE_KEY
P, kv_p = [1, 2, 3, 4, 5, 6, 7, 8, 30, 31], kv(10, 2)
mounted.manager.pin(BUNDLE_KEY, P, kv_p, "p@1")
cache_info = NS(file_sha256="0" * 64, kv_bits=None)
mounted.result.bundles.append(NS(name="p@1", tokens=P, manifest=NS(cache=cache_info)))
pinned = cls(None, paged.PagedCacheManager(block_size=4, max_blocks=64))
pinned.extract = states
table, rest = pinned.fetch_cache("q", P + [40])
cache = pinned.reconstruct_cache(table)
out["p"] = [table.num_tokens, len(rest), bool(table), cache[0].offset,
            mx.array_equal(cache[0].keys, kv_p[0].keys[..., :10, :]).item(),
            pinned.paged_cache.get_block_table("prefix-bundles:p@1").block_ids != []]
pinned.fetch_cache("w", [50, 51, 52, 53, 54])
mounted.result.bundles.clear()
mounted.manager.unpin(BUNDLE_KEY, "p@1")
table, rest = pinned.fetch_cache("z", P + [40])
late = pinned.store_cache("w", [50, 51, 52, 53, 54], states(kv(5, 3)))
out["withdrawn"] = [table is None, late is None, pinned.held,
                    pinned.paged_cache.get_block_table("prefix-bundles:p@1") is None]

# --snapshots: what the class lists is each stored request's proven blocks, their K/V rebuilt by
# the engine's reconstruct (exactly the stored K/V); a prefix of a longer entry is not listed; the
# capture is asked at each store; what the cache held at the engine's stop is kept past its clear
class Shelf:  # the Snapshots calls the class makes, with no restored snapshot on it
    changes, clock = 0, 0
    def tick(self):
        self.clock += 1
        return self.clock
    def changed(self):
        self.changes += 1
    covered = lossy_floor = lambda self, tokens: 0
    fetch = lambda self, tokens, better_than: (None, 0, "")

shelf = Shelf()
listing = pinned_paged_cache_class(
    mounted, prefix.BlockAwarePrefixCache, paged.BlockTable, pkg, shelf)
spilled = listing(None, paged.PagedCacheManager(block_size=4, max_blocks=64))
for rid, ids, cache in (("a", A, kv_a), ("a8", A[:8], kv(8, 4)), ("b", B, kv_b)):
    spilled.fetch_cache(rid, ids)
    spilled.store_cache(rid, ids, states(cache))
def listed():
    return [[t, mx.array_equal(c[0].keys, w[0].keys[..., : len(t), :]).item()]
            for _, t, c in spilled.entries() for w in ([kv_a] if t == A else [kv_b])]
out["listed"] = [listed(), shelf.changes]
shelf.budget = 1  # bytes: the hottest entry alone is rebuilt
out["bounded"] = listed()
del shelf.budget
spilled.keep()
spilled.clear()
out["kept"] = listed()
print(json.dumps(out))
"""


@pytest.mark.parametrize("server", list(SERVERS))
def test_the_engines_own_cache_holds_bundles_and_hands_out_only_proven_blocks(
    server: str, tmp_path: Path
):
    import subprocess

    python, _ = SERVERS[server]
    package = server.replace("-", "_")
    done = subprocess.run(
        [str(python()), "-c", ENGINE_CHECK, package],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    # vllm-mlx's own store puts A's second block in B's table; rapid-mlx's does not
    assert out["engine_reuses"] is (server == "vllm-mlx"), out
    # under serve B is not stored with A's block (released), or stored with its own
    assert out["stored"] == [True, server != "vllm-mlx"], out
    assert out["ra"] == [8, 8, 1, True], out  # A's two blocks: exactly A's K/V
    assert out["rb"] == ([0, 0, 9, True] if server == "vllm-mlx" else [8, 8, 1, True]), out
    assert out["x"] == [8, 8, 1, True], out  # A's own prompt: whole blocks, a token left
    # the bundle: all 10 of its tokens (not 8: whole blocks), exactly its K/V, held as blocks
    assert out["p"] == [10, 1, True, 10, True, True], out
    # withdrawn: the cache cleared, nothing of it served, the request in flight stores nothing
    assert out["withdrawn"] == [True, True, {}, True], out
    # --snapshots: A listed with exactly its K/V; A[:8] (held by A) not; B only where stored
    a, b = [1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 5, 6, 7, 8, 9]
    listed = [[a, True]] if server == "vllm-mlx" else [[a, True], [b, True]]
    assert out["listed"][0] in (listed, listed[::-1]), out
    assert out["listed"][1] == (2 if server == "vllm-mlx" else 3), out  # a capture per store
    assert out["kept"] == out["listed"][0], out  # past the engine's clear at its stop
    hottest = [[a, True]] if server == "vllm-mlx" else [[b, True]]
    assert out["bounded"] == hottest, out  # within a 1-byte budget: the hottest entry alone
