"""serve --snapshots: the server's entries saved at a graceful stop, signed with the host key, and
mounted at the next start through the one validator (pipeline.runtime.snapshots)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import servers_env
from test_serve import ROOT, admin, server_process

from pipeline.format.bundle_folder import CACHE_FILE, MANIFEST_FILE, SIGNATURE_FILE, SUMS_FILE
from pipeline.format.errors import PipelineError
from pipeline.format.fingerprint import file_digests, sha256_bytes
from pipeline.format.manifest import Manifest, manifest_bytes
from pipeline.format.secret_key import generate
from pipeline.runtime.servers.options import parse_size
from pipeline.runtime.snapshot_store import MARK_TEXT, SET_MARK, Entry
from pipeline.runtime.snapshots import DEFAULT_BUDGET, Snapshots

TOKENS = [(7 * i + 3) % 900 + 10 for i in range(300)]


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A host key folder of the test's own (XDG_CONFIG_HOME)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path / "config" / "mlx-prefix-bundles" / "snapshot-host.key"


def prefilled(model_dir: Path, tokens: list[int]) -> list:
    """The model's prompt cache after `tokens` (what mlx_lm.server keeps after a request)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(model_dir))
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([tokens]), cache=cache))
    return cache


def save_one(root: Path, model_dir: Path, lossy: bool = False) -> Path:
    """A set of one snapshot of TOKENS written by serve's code; the snapshot folder."""
    snaps = Snapshots(root, DEFAULT_BUDGET, model_dir, None, "mlx-lm")
    entry = Entry(TOKENS, prefilled(model_dir, TOKENS), "test", lossy)
    snaps.save([(1, entry)], lambda ids: 0)
    snaps.close()
    (folder,) = (p for p in (root / "set-1").iterdir() if p.name != SET_MARK)
    return folder


def restore(root: Path, model_dir: Path, caplog: pytest.LogCaptureFixture) -> Snapshots:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="prefix-bundles"):
        snaps = Snapshots(root, DEFAULT_BUDGET, model_dir, None, "mlx-lm")
        snaps.restore([])
    return snaps


def test_a_saved_snapshot_is_restored_and_serves_under_the_rule(
    tmp_path: Path, tiny_model: Path, host: Path, caplog
):
    folder = save_one(tmp_path / "snaps", tiny_model)
    manifest = Manifest.model_validate_json((folder / MANIFEST_FILE).read_bytes())
    assert (manifest.kind, manifest.prefix, manifest.snapshot.lossy) == ("snapshot", None, False)
    assert manifest.tokens.count == len(TOKENS)
    assert os.stat(host).st_mode & 0o777 == 0o600
    assert os.stat(host.parent).st_mode & 0o777 == 0o700
    assert os.stat(tmp_path / "snaps").st_mode & 0o777 == 0o700
    assert all(os.stat(p).st_mode & 0o777 == 0o600 for p in folder.iterdir())
    snaps = restore(tmp_path / "snaps", tiny_model, caplog)
    assert "snapshots: restored 1 of 1" in caplog.text
    request = [*TOKENS, 11, 12]
    cache, keep, name = snaps.fetch(request, better_than=0)
    assert (keep, name) == (len(TOKENS), folder.name)
    assert cache[0].offset == len(TOKENS)
    # it never beats what a bundle (or the server's own entry) already covers
    assert snaps.fetch(request, better_than=len(TOKENS))[0] is None
    snaps.close()


def test_a_lossy_snapshot_serves_only_its_share(
    tmp_path: Path, tiny_model: Path, host: Path, caplog
):
    save_one(tmp_path / "snaps", tiny_model, lossy=True)
    snaps = restore(tmp_path / "snaps", tiny_model, caplog)
    short = [*TOKENS[:100], 5, 6]  # a third of it: an exact entry would serve 100 tokens
    assert snaps.fetch(short, better_than=0)[0] is None
    assert snaps.lossy_floor(short) == 0  # no request took it: no entry descends from it
    assert snaps.fetch([*TOKENS[:200], 5], better_than=0)[1] == 200
    assert snaps.lossy_floor(short) == 150  # one did: entries sharing its opening are held
    snaps.close()


def _tamper(folder: Path) -> None:
    """One K/V byte edited, the manifest's pins and SHA256SUMS recomputed (signature kept)."""
    data = bytearray((folder / CACHE_FILE).read_bytes())
    data[-7] ^= 0x40
    (folder / CACHE_FILE).write_bytes(bytes(data))
    d = file_digests(folder / CACHE_FILE)
    m = Manifest.model_validate_json((folder / MANIFEST_FILE).read_bytes())
    cache = m.cache.model_copy(update={"file_sha256": d.sha256, "file_blake3": d.blake3})
    text = manifest_bytes(m.model_copy(update={"cache": cache}))
    (folder / MANIFEST_FILE).write_bytes(text)
    (folder / SUMS_FILE).write_text(
        f"{d.sha256}  {CACHE_FILE}\n{sha256_bytes(text)}  {MANIFEST_FILE}\n"
    )


def _other_key(folder: Path) -> None:
    from pipeline.format.bundle_signature import trusted_comment

    data = (folder / MANIFEST_FILE).read_bytes()
    comment = trusted_comment(Manifest.model_validate_json(data))
    (folder / SIGNATURE_FILE).write_bytes(generate().sign(data, comment).file_bytes())


def _truncate(folder: Path) -> None:
    path = folder / CACHE_FILE
    path.write_bytes(path.read_bytes()[:-1000])


REFUSALS = [
    ("tampered", _tamper, "does not verify over manifest.json"),
    ("other key", _other_key, "which is not trusted"),
    ("unsigned", lambda f: (f / SIGNATURE_FILE).unlink(), "manifest.json.minisig is missing"),
    ("truncated", _truncate, "(truncated or replaced)"),
]


@pytest.mark.parametrize("case, damage, reason", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_an_altered_snapshot_is_refused_with_one_line(
    tmp_path: Path, tiny_model: Path, host: Path, caplog, case, damage, reason
):
    folder = save_one(tmp_path / "snaps", tiny_model)
    damage(folder)
    snaps = restore(tmp_path / "snaps", tiny_model, caplog)
    refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused")]
    assert len(refusals) == 1 and reason in refusals[0], caplog.text
    assert "restored 0 of 1" in caplog.text
    assert snaps.fetch([*TOKENS, 1], better_than=0)[0] is None
    snaps.close()


def test_a_snapshot_of_another_model_is_refused(
    tmp_path: Path, tiny_model: Path, tiny_model_other_weights: Path, host: Path, caplog
):
    save_one(tmp_path / "snaps", tiny_model)
    snaps = restore(tmp_path / "snaps", tiny_model_other_weights, caplog)
    assert "model weights/config mismatch" in caplog.text
    assert "a snapshot is used only by the model that wrote it" in caplog.text
    assert "restored 0 of 1" in caplog.text
    snaps.close()


def test_one_serve_per_folder(tmp_path: Path, tiny_model: Path, host: Path):
    first = Snapshots(tmp_path / "snaps", DEFAULT_BUDGET, tiny_model, None, "mlx-lm")
    with pytest.raises(PipelineError) as exc:
        Snapshots(tmp_path / "snaps", DEFAULT_BUDGET, tiny_model, None, "mlx-lm")
    assert str(exc.value) == (
        f"--snapshots {tmp_path / 'snaps'} is in use by another serve process (it holds "
        f"{tmp_path / 'snaps' / '.lock'}); give each serve its own snapshot folder"
    )
    first.close()


def test_a_stop_cut_short_leaves_the_previous_set(
    tmp_path: Path, tiny_model: Path, host: Path, caplog
):
    save_one(tmp_path / "snaps", tiny_model)
    staging = tmp_path / "snaps" / ".staging-1-2"
    (staging / "00-half").mkdir(parents=True)  # a crash mid-save
    (staging / SET_MARK).write_bytes(MARK_TEXT)
    snaps = restore(tmp_path / "snaps", tiny_model, caplog)
    assert "restored 1 of 1 from" in caplog.text
    assert sorted(p.name for p in (tmp_path / "snaps").iterdir()) == [".lock", "set-1"]
    snaps.close()


@pytest.mark.parametrize(
    "text, size", [("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1000", 1000), ("3 kib", 3072)]
)
def test_budget_sizes(text: str, size: int):
    assert parse_size(text) == size


def test_a_budget_that_is_not_a_size():
    with pytest.raises(PipelineError, match="--snapshot-budget '2 GB' is not a size"):
        parse_size("2 GB")


# --- end to end: the real mlx_lm.server through build.py serve ------------------------------

SYSTEM = "You are a careful archivist. " + " ".join(
    f"Record {i}: shelf {i % 17}, box {i % 5}, note lorem ipsum." for i in range(120)
)


def turn(port: int, answer: str | None = None, model: Path | None = None) -> dict:
    """The conversation's first turn, or (with the first answer) its second; `model`: the model
    id to send (mlx_lm.server answers without one)."""

    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Which shelf holds record 42?"},
    ]
    if answer is not None:
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And record 43?"},
        ]
    body = {"messages": messages, "max_tokens": 12, "temperature": 0.0}
    return servers_env.chat(port, body | ({"model": str(model)} if model else {}))[0]


@pytest.mark.slow
def test_a_conversation_survives_a_restart(tmp_path: Path, tiny_model: Path):
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")}
    bundles, snaps = tmp_path / "bundles", tmp_path / "snaps"
    bundles.mkdir()
    with server_process(tiny_model, bundles, tmp_path / "ref.log", env=env) as (_, port):
        first = turn(port)
        answer = first["choices"][0]["message"]["content"]
        reference = turn(port, answer)
    prompt = first["usage"]["prompt_tokens"]
    assert prompt > 3000 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    # spilled while serving (--snapshot-every: at most every 0.06 s), then a crash (SIGKILL: no
    # stop-time save): the spilled set is what the restart mounts
    log1 = tmp_path / "serve1.log"
    every = ("--snapshot-every", "0.001")
    with server_process(tiny_model, bundles, log1, "--snapshots", str(snaps), *every, env=env) as (
        p,
        port,
    ):
        assert turn(port)["choices"][0]["message"]["content"] == answer
        wait_for_periodic(log1, beyond=prompt)  # the entry with the answer, not a segment's
        p.kill()
        p.wait(timeout=60)

    log2 = tmp_path / "serve2.log"
    admin_port = servers_env.free_port()
    extra = ("--snapshots", str(snaps), "--admin-port", str(admin_port))
    with server_process(tiny_model, bundles, log2, *extra, env=env) as (p, port):
        second = turn(port, answer)
        # a second serve on the same folder is refused with one line
        other = subprocess.run(
            [sys.executable, str(ROOT / "build.py"), "serve", "--model", str(tiny_model),
             "--bundles", str(bundles), "--port", str(servers_env.free_port()),
             "--snapshots", str(snaps)],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        # the graceful stop asked of the admin endpoint (as SIGTERM): the set is saved first
        assert admin(admin_port, "POST", "/v1/stop") == (202, {"stopping": True})
        assert p.wait(timeout=60) == 0
    assert other.returncode == 1
    assert other.stderr.strip().splitlines()[-1].startswith(f"error: --snapshots {snaps} is in use")
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 0.99 * prompt, (cached, prompt)
    assert (
        second["choices"][0]["message"]["content"] == reference["choices"][0]["message"]["content"]
    )
    assert cached == reference["usage"]["prompt_tokens_details"]["cached_tokens"]
    text = log2.read_text()
    assert "snapshots: restored 1 of 1" in text and "0 refused" in text
    assert "request: snapshot 00-" in text
    assert "snapshots: saved 2 entries" in text  # at the graceful stop: the restored one kept
    assert "admin: a graceful stop was asked for" in text


def wait_for_periodic(log: Path, beyond: int, timeout: float = 30) -> None:
    """Until the log says a spill while serving wrote one entry of more than `beyond` tokens."""
    import re

    pattern = r"saved 1 entry \((\d+) tokens.*\(spilled while serving"
    deadline = time.monotonic() + timeout
    while not any(int(n) > beyond for n in re.findall(pattern, log.read_text())):
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


def test_prune_snapshots_lists_then_wipes_and_is_refused_while_serve_uses_the_folder(
    tmp_path: Path, tiny_model: Path, host: Path, capsys
):
    from pipeline.cli import main

    root = tmp_path / "snaps"
    save_one(root, tiny_model)
    assert main(["prune", "--snapshots", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"would delete {root / 'set-1'}" and out[-1].startswith("1 snapshot set, ")
    assert (root / "set-1").is_dir()  # a dry run
    serving = Snapshots(root, DEFAULT_BUDGET, tiny_model, None, "mlx-lm")
    assert main(["prune", "--snapshots", str(root), "--apply"]) == 1
    assert "is in use by another serve process" in capsys.readouterr().err
    serving.close()
    assert main(["prune", "--snapshots", str(root), "--apply"]) == 0
    assert capsys.readouterr().out.startswith(f"deleted 1 folder under {root}")
    assert sorted(p.name for p in root.iterdir()) == [".lock"]


@pytest.mark.parametrize("stop", [lambda: 0, "interrupt"])
def test_serve_saves_after_the_servers_graceful_stop(monkeypatch: pytest.MonkeyPatch, stop):
    """uvicorn re-raises the SIGTERM it captured after its graceful shutdown (our handler makes it
    a KeyboardInterrupt): serve still saves the entries, once, and exits 0."""
    from types import SimpleNamespace

    from pipeline.runtime.servers import startup
    from pipeline.runtime.servers.hook import ServerHook

    saved = []
    snaps = SimpleNamespace(
        save=lambda listed, covered: saved.append(listed), stop_saving=lambda: saved.append("stop")
    )
    for name in ("require", "refuse_options", "check_port", "check_admin", "setup_logging"):
        monkeypatch.setattr(startup, name, lambda *a, **k: None)
    monkeypatch.setattr(startup, "ensure_huge_pages", lambda *a, **k: None)
    mount = SimpleNamespace(
        covered=len, loaded_as_fingerprinted=lambda: True, result=SimpleNamespace(bundles=[])
    )
    monkeypatch.setattr(startup, "mount_for", lambda *a, **k: mount)
    monkeypatch.setattr(startup, "check_tokenization", lambda *a: {})
    monkeypatch.setattr(startup, "open_snapshots", lambda *a: snaps)
    monkeypatch.setattr(startup, "try_it", lambda *a: "")

    class Hook(ServerHook):
        name, package, address, snapshots = "mlx-lm", "json", ("127.0.0.1", 1), True

        def install(self, mounted, options, snapshots=None) -> None: ...

        def launch(self, mounted, options) -> int:
            if stop == "interrupt":
                raise KeyboardInterrupt
            return stop()

        def entries(self, mounted, snapshots) -> list:
            return ["entry"]

    options = SimpleNamespace(snapshots=Path("s"), snapshot_budget="2GiB", rest=(), warm_up=False, huge_pages=None,
                              argv=(), passed=lambda o: None)  # fmt: skip
    assert startup.serve(Hook(), options) == 0
    assert saved == ["stop", ["entry"]]
