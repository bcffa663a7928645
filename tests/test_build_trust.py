"""What the builder refuses, and what it never does to a bundle already built (real builds).

One test (or case) per finding of the build-side trust review: each asserts the exact refusal and
that no bundle was written or replaced.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pipeline.builder.definition import load_definition
from pipeline.builder.render import check_rendered, render_prefix
from pipeline.builder.writer import (
    clean_staging,
    new_staging_folder,
    publish,
    staging_root,
    target_lock,
)
from pipeline.cli import main
from pipeline.format.bundle_folder import CACHE_FILE, MANIFEST_FILE, STAGING_DIR, model_folder
from pipeline.format.errors import BuildError, DefinitionError, ModelError, TemplateError
from pipeline.format.fingerprint import model_fingerprint, sha256_text
from pipeline.format.lockfile import LOCK_NAME

from conftest import SYSTEM, build_bundle, write_definition

TEMPLATES = Path(__file__).parent / "templates"


# --- helpers ---------------------------------------------------------------------------------------


def cli(root: Path, *argv: str, bundles: Path | None = None) -> int:
    bundles = bundles or root / "bundles"
    return main(["--prefixes", str(root / "prefixes"), "--bundles", str(bundles), *argv])


def one_error(capsys, rc: int) -> str:
    """The CLI refused: exit 1, exactly one `error: ` line on stderr, no traceback; return it."""
    return error_line(rc, capsys.readouterr().err)


def error_line(rc: int, err: str) -> str:
    assert rc == 1, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def snapshot(bundles: Path) -> dict[str, bytes]:
    """Every file under the bundles folder (staging left out) with its bytes."""
    if not bundles.is_dir():
        return {}
    return {
        str(p.relative_to(bundles)): p.read_bytes()
        for p in sorted(bundles.rglob("*"))
        if p.is_file() and STAGING_DIR not in p.relative_to(bundles).parts
    }


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def copy_model(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def no_hang(fn, timeout: float = 30):
    """Run fn in a daemon thread; fail (instead of hanging the suite) when it blocks."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed back to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn} blocked for {timeout}s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def file_template_definition(
    root: Path, model: Path, template: str, messages: str, file: str = "fold/template.jinja"
) -> Path:
    """prefixes/fold.toml pinning `template` as template.file (written to fold/template.jinja)."""
    folder = root / "prefixes" / "fold"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "template.jinja").write_text(template)
    path = root / "prefixes" / "fold.toml"
    path.write_text(
        f'name = "fold"\nversion = 1\n\n[template]\nsource = "file"\nfile = {json.dumps(file)}\n'
        f'sha256 = "{sha256_text(template)}"\n\n{messages}\n[[models]]\npath = "{model}"\n'
    )
    return path


SYSTEM_ONLY = f'[[prefix.messages]]\nrole = "system"\ncontent = {json.dumps(SYSTEM)}\n'


# --- 1. a model folder without its tokenizer vocabulary --------------------------------------------


def test_model_without_tokenizer_json_is_refused(tmp_path: Path, tiny_model: Path, capsys):
    model = copy_model(tiny_model, tmp_path / "models" / "tiny")
    (model / "tokenizer.json").unlink()
    write_definition(tmp_path, model)
    with pytest.raises(ModelError, match="no tokenizer vocabulary") as exc:
        build_bundle(tmp_path)
    assert str(exc.value).startswith(f"model {model}: no tokenizer vocabulary (tokenizer.json, ")
    line = one_error(capsys, cli(tmp_path, "build", "--model", str(model)))
    assert line == f"error: {exc.value}"
    assert snapshot(tmp_path / "bundles") == {}


# --- 2. a template that folds the system turn; template.file confinement ---------------------------


def test_template_folding_a_system_only_prefix_is_refused(tmp_path: Path, tiny_model: Path, capsys):
    template = (TEMPLATES / "gemma_system_in_user.jinja").read_text()
    path = file_template_definition(tmp_path, tiny_model, template, SYSTEM_ONLY)
    with pytest.raises(TemplateError) as exc:
        build_bundle(tmp_path, name="fold")
    assert str(exc.value) == (
        f"{path}: prefix.messages.0: the system content does not appear in the rendered prefix "
        "(the template folds or drops a system turn when nothing follows it); add a user turn to "
        "the prefix or use a template that renders system turns"
    )
    assert one_error(capsys, cli(tmp_path, "build", "fold")) == f"error: {exc.value}"
    assert snapshot(tmp_path / "bundles") == {}
    # the advice works: with a user turn after it, the system text is rendered (into that turn)
    user_turn = '[[prefix.messages]]\nrole = "user"\ncontent = "Where is my order?"\n'
    path = file_template_definition(tmp_path, tiny_model, template, SYSTEM_ONLY + user_turn)
    definition = load_definition(path, tmp_path)
    check_rendered(definition, render_prefix(definition, tiny_model).text)


@pytest.mark.parametrize("where", ["parent", "absolute", "symlink"])
def test_template_file_outside_the_definition_folder_is_refused(
    tmp_path: Path, tiny_model: Path, where: str
):
    outside = tmp_path / "outside.jinja"
    outside.write_text("{{ bos_token }}")
    (tmp_path / "prefixes" / "fold").mkdir(parents=True)
    if where == "symlink":
        (tmp_path / "prefixes" / "fold" / "link.jinja").symlink_to(outside)
    rel = {"parent": "../outside.jinja", "absolute": str(outside), "symlink": "fold/link.jinja"}
    path = file_template_definition(
        tmp_path, tiny_model, "{{ bos_token }}", SYSTEM_ONLY, file=rel[where]
    )
    with pytest.raises(DefinitionError) as exc:
        load_definition(path, tmp_path)
    assert str(exc.value) == (
        f"{path}: template.file: '{rel[where]}' is outside the definition's folder "
        f"{path.parent.resolve()}; move the file under it"
    )


# --- 3. empty content; tools without the OpenAI function wrapper ---------------------------------


@pytest.mark.parametrize("content", ["", " \n\t "])
def test_empty_message_content_is_refused(tmp_path: Path, tiny_model: Path, content: str):
    path = write_definition(tmp_path, tiny_model)
    edit(path, f"content = {json.dumps(SYSTEM)}", f"content = {json.dumps(content)}")
    with pytest.raises(DefinitionError) as exc:
        load_definition(path, tmp_path)
    assert str(exc.value) == (
        f"{path}: prefix.messages.0: content is empty; write the message text or remove the message"
    )


def test_tools_without_function_wrapper_are_refused(tmp_path: Path, tiny_model: Path, capsys):
    path = write_definition(tmp_path, tiny_model)
    (tmp_path / "prefixes/shop/tools.json").write_text('[{"name": "f", "parameters": {}}]')
    with pytest.raises(DefinitionError) as exc:
        load_definition(path, tmp_path)
    message = str(exc.value)
    assert message.startswith(f"{path}: prefix.tools_file: tool 0: ")
    assert message.endswith(
        'write OpenAI function tools: {"type": "function", "function": {"name": ..., '
        '"description": ..., "parameters": {...}}}'
    )
    assert one_error(capsys, cli(tmp_path, "build")) == f"error: {message}"
    assert snapshot(tmp_path / "bundles") == {}


# --- 4. version discipline: built bundles, the lockfile, --locked, older versions ----------------


def test_content_change_without_version_bump_is_refused_even_with_force(
    tmp_path: Path, tiny_model: Path, capsys
):
    path = write_definition(tmp_path, tiny_model)
    bundle = build_bundle(tmp_path)
    before = snapshot(tmp_path / "bundles")
    edit(path, "Be brief", "Be very brief")
    expected = (
        f"{path}: content changed since version 1 was built ({bundle}); "
        f"bump version (now 1) in {path}"
    )
    with pytest.raises(BuildError) as exc:
        build_bundle(tmp_path)
    assert str(exc.value) == expected
    assert one_error(capsys, cli(tmp_path, "build", "--force")) == f"error: {expected}"
    assert snapshot(tmp_path / "bundles") == before
    assert not (tmp_path / "prefixes" / LOCK_NAME).exists()


def test_content_change_is_refused_by_the_lockfile_alone(tmp_path: Path, tiny_model: Path, capsys):
    path = write_definition(tmp_path, tiny_model)
    assert cli(tmp_path, "build", "--no-check") == 0
    lock = json.loads((tmp_path / "prefixes" / LOCK_NAME).read_text())
    locked = lock["prefixes"]["shop"]["content_sha256"]
    shutil.rmtree(tmp_path / "bundles")  # e.g. a fresh CI checkout: only prefixes.lock remembers
    edit(path, "Be brief", "Be very brief")
    now = load_definition(path, tmp_path).content_sha256
    capsys.readouterr()
    line = one_error(capsys, cli(tmp_path, "build", "--force", "--no-check"))
    assert line == (
        f"error: {path}: content changed since version 1 was locked in prefixes.lock "
        f"({locked[:12]}.. locked, {now[:12]}.. now); bump version (now 1) in {path}"
    )
    assert snapshot(tmp_path / "bundles") == {}


def test_build_locked_builds_what_is_locked_and_never_writes_the_lockfile(
    tmp_path: Path, tiny_model: Path, tiny_model_other_weights: Path, capsys
):
    path = write_definition(tmp_path, tiny_model)
    assert cli(tmp_path, "build", "--no-check") == 0
    lock_file = tmp_path / "prefixes" / LOCK_NAME
    lock_bytes, lock_mtime = lock_file.read_bytes(), lock_file.stat().st_mtime_ns
    shutil.rmtree(tmp_path / "bundles")
    assert cli(tmp_path, "build", "--locked", "--no-check") == 0  # rebuilds the locked bundle
    assert cli(tmp_path, "build", "--locked", "--no-check") == 0  # up to date
    assert capsys.readouterr().out.splitlines()[-1].startswith("shop@1 -> tiny: up to date (")
    built = snapshot(tmp_path / "bundles")
    assert len(built) == 4

    # a model that is not in the lock: refused before anything is built for it
    rc = cli(tmp_path, "build", "--locked", "--no-check", "--model", str(tiny_model_other_weights))
    line = one_error(capsys, rc)
    assert line.startswith(f"error: {path}: models differs from prefixes.lock (")
    assert line.endswith("run 'prefix-bundles build' and commit prefixes.lock")

    # a new version of the definition: refused before its bundle is built
    edit(path, "Be brief", "Be very brief")
    edit(path, "version = 1", "version = 2")
    line = one_error(capsys, cli(tmp_path, "build", "--locked", "--no-check"))
    assert line == (
        f"error: {path}: version differs from prefixes.lock (1 locked, 2 now); "
        "run 'prefix-bundles build' and commit prefixes.lock"
    )
    assert snapshot(tmp_path / "bundles") == built
    assert lock_file.read_bytes() == lock_bytes and lock_file.stat().st_mtime_ns == lock_mtime


def test_version_older_than_the_locked_one_is_refused(tmp_path: Path, tiny_model: Path, capsys):
    path = write_definition(tmp_path, tiny_model)
    assert cli(tmp_path, "build", "--no-check") == 0
    edit(path, "Be brief", "Be very brief")
    edit(path, "version = 1", "version = 2")
    assert cli(tmp_path, "build", "--no-check") == 0
    before = snapshot(tmp_path / "bundles")
    # back to version 1 and its content (its bundle still exists)
    edit(path, "Be very brief", "Be brief")
    edit(path, "version = 2", "version = 1")
    capsys.readouterr()
    line = one_error(capsys, cli(tmp_path, "build", "--force", "--no-check"))
    assert line == (
        f"error: {path}: version 1 is older than the locked version 2; bump version (now 1) in {path}"
    )
    assert snapshot(tmp_path / "bundles") == before


# --- 5. model identity, not folder names ---------------------------------------------------------


def test_same_folder_name_other_weights_get_their_own_bundles(
    tmp_path: Path, tiny_model: Path, tiny_model_other_weights: Path, capsys
):
    write_definition(tmp_path, tiny_model)
    a = copy_model(tiny_model, tmp_path / "a" / "tiny")
    b = copy_model(tiny_model_other_weights, tmp_path / "b" / "tiny")
    assert cli(tmp_path, "build", "--no-check", "--model", str(a)) == 0
    first = snapshot(tmp_path / "bundles")
    assert cli(tmp_path, "build", "--no-check", "--model", str(b)) == 0
    folders = {model_folder("tiny", model_fingerprint(m)): m for m in (a, b)}
    assert len(folders) == 2
    assert sorted(p.name for p in (tmp_path / "bundles/shop/1").iterdir()) == sorted(folders)
    for name, model in folders.items():
        manifest = json.loads((tmp_path / "bundles/shop/1" / name / MANIFEST_FILE).read_text())
        assert manifest["model"]["fingerprint"] == model_fingerprint(model)
    after = snapshot(tmp_path / "bundles")
    assert {k: after[k] for k in first} == first  # the first model's bundle is untouched
    lock = json.loads((tmp_path / "prefixes" / LOCK_NAME).read_text())
    assert set(lock["prefixes"]["shop"]["models"]) == set(folders)


# --- 6. atomic replace, staging cleanup, racing builds -------------------------------------------


class Watcher:
    """A thread that checks, as fast as it can, that a bundle path always holds a manifest."""

    def __init__(self, bundle: Path) -> None:
        self.bundle, self.checks, self.gaps = bundle, 0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.checks += 1
            if not (self.bundle / MANIFEST_FILE).is_file():
                self.gaps += 1

    def __enter__(self) -> Watcher:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def test_publish_replaces_a_bundle_without_a_gap(tmp_path: Path):
    bundles = tmp_path / "bundles"
    dest = bundles / "shop" / "1" / "tiny-0123456789ab"

    def staged(generation: int) -> Path:
        tmp = new_staging_folder(bundles)
        (tmp / CACHE_FILE).write_text(f"cache {generation}")
        (tmp / MANIFEST_FILE).write_text(f"manifest {generation}")
        return tmp

    publish(bundles, staged(0), dest)
    with Watcher(dest) as watcher:
        for generation in range(1, 201):
            publish(bundles, staged(generation), dest)
    assert watcher.gaps == 0 and watcher.checks > 0
    assert (dest / CACHE_FILE).read_text() == "cache 200"
    assert (dest / MANIFEST_FILE).read_text() == "manifest 200"
    assert list(staging_root(bundles).iterdir()) == []  # every replaced bundle was removed


def test_force_rebuild_never_leaves_the_bundle_path_empty(project: Path):
    bundle = build_bundle(project)
    with Watcher(bundle) as watcher:
        build_bundle(project, force=True)
        build_bundle(project, force=True)
    assert watcher.gaps == 0 and watcher.checks > 0
    assert build_bundle(project) == bundle  # valid and up to date


def test_clean_staging_removes_only_dead_builds(tmp_path: Path):
    bundles = tmp_path / "bundles"
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True)  # fmt: skip
    dead_pid = int(done.stdout)
    root = staging_root(bundles)
    for name in (f"{dead_pid}-xxxx", f"{os.getpid()}-yyyy", "locks"):
        (root / name).mkdir(parents=True)
        (root / name / "file").write_text("x")
    assert clean_staging(bundles) == [root / f"{dead_pid}-xxxx"]
    assert sorted(p.name for p in root.iterdir()) == sorted([f"{os.getpid()}-yyyy", "locks"])


def test_clean_staging_never_sweeps_another_hosts_build(tmp_path: Path):
    """A staging folder tagged with another host (or container: another pid namespace) is kept
    even when its pid is not alive here: that build may be running there."""
    from pipeline.builder.writer import host_tag, new_staging_folder

    bundles = tmp_path / "bundles"
    mine = new_staging_folder(bundles)
    assert mine.name.endswith(f".{host_tag()}")
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True)  # fmt: skip
    dead_pid = int(done.stdout)
    root = staging_root(bundles)
    (root / f"{dead_pid}-aaaa.0123456789ab").mkdir()  # another host's live build
    (root / f"{dead_pid}-bbbb.{host_tag()}").mkdir()  # this host's dead build
    assert clean_staging(bundles) == [root / f"{dead_pid}-bbbb.{host_tag()}"]
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [f"{dead_pid}-aaaa.0123456789ab", mine.name]
    )


def test_build_refuses_while_another_build_holds_the_target(project: Path):
    bundle = build_bundle(project)
    before = snapshot(project / "bundles")
    with target_lock(project / "bundles", bundle):
        with pytest.raises(BuildError) as exc:
            build_bundle(project, force=True)
    assert str(exc.value) == (
        f"another build is writing {bundle} right now; wait for it to finish (its bundle is kept)"
    )
    assert snapshot(project / "bundles") == before
    assert build_bundle(project) == bundle  # still valid and up to date


# --- 7. OS errors are one line, before the prefill; not enough space ------------------------------


@pytest.mark.parametrize("where", ["parent is a file", "bundles is a file"])
def test_unwritable_bundles_folder_is_one_line_before_prefill(project: Path, capsys, where: str):
    blocker = project / "not-a-folder"
    blocker.write_text("a regular file")
    bundles = blocker / "bundles" if where == "parent is a file" else blocker
    rc = cli(project, "build", "--no-check", bundles=bundles)
    err = capsys.readouterr().err
    assert "prefill" not in err, err  # refused before the model ran
    line = error_line(rc, err)
    assert line.startswith(f"error: cannot write {blocker}/") and line.endswith(
        ": Not a directory; make the bundles folder writable or pass --bundles"
    ), line
    assert blocker.read_text() == "a regular file"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through a read-only mode")
def test_read_only_bundles_folder_is_one_line_before_prefill(project: Path, capsys):
    bundles = project / "bundles"
    bundles.mkdir()
    bundles.chmod(0o555)
    try:
        rc = cli(project, "build", "--no-check")
    finally:
        bundles.chmod(0o755)
    err = capsys.readouterr().err
    assert "prefill" not in err, err
    line = error_line(rc, err)
    assert line.startswith(f"error: cannot write {bundles}/") and line.endswith(
        ": Permission denied; make the bundles folder writable or pass --bundles"
    ), line
    assert snapshot(bundles) == {}


def test_a_name_relative_to_a_folder_descriptor_is_shown_under_the_bundles_root(
    project: Path, monkeypatch
):
    """safe_tree works through folder descriptors, so an OSError names only the last part
    of the path: the message says under which bundles folder it is."""

    def read_only(bundles_root):
        raise OSError(30, "Read-only file system", "4242-0badc0de.0123456789ab")

    monkeypatch.setattr("pipeline.builder.builder.new_staging_folder", read_only)
    with pytest.raises(BuildError) as exc:
        build_bundle(project)
    assert str(exc.value) == (
        f"cannot write 4242-0badc0de.0123456789ab under {project / 'bundles'}: Read-only file "
        "system; make the bundles folder writable or pass --bundles"
    )


def test_not_enough_space_is_refused_before_prefill(project: Path, monkeypatch):
    monkeypatch.setattr("pipeline.builder.builder.free_bytes", lambda root: 1000)
    calls: list = []
    with pytest.raises(BuildError) as exc:
        build_bundle(project, progress=lambda *a: calls.append(a))
    assert str(exc.value).startswith(
        f"cannot write {project / 'bundles'}: No space left on device (needs about "
    )
    assert str(exc.value).endswith(" MiB, 0 MiB free); free some space or pass --bundles")
    assert calls == []  # the prefill never started
    assert snapshot(project / "bundles") == {}
    assert [p.name for p in staging_root(project / "bundles").iterdir()] == ["locks"]


def test_a_cache_write_cut_short_is_one_line_and_keeps_the_old_bundle(project: Path, capsys):
    """mlx raises RuntimeError ("[write] Unable to write ...") where Python raises OSError: a file
    size limit hit mid-write (as a full disk after the free-space check) is one line naming the
    bundle and what to do, in --json too; the old bundle stays, nothing is left in staging."""
    import resource

    bundle = build_bundle(project)
    before = snapshot(project / "bundles")
    limit = (bundle / CACHE_FILE).stat().st_size // 2
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    capsys.readouterr()
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))  # Python ignores SIGXFSZ
    try:
        rc = cli(project, "build", "--force", "--no-check", "--json")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
    out, err = capsys.readouterr()
    expected = (
        f"cannot write {bundle}: the disk is full or the file size limit was hit (needs about "
    )
    tail = (
        " MiB); nothing was published, any earlier bundle there is kept; free space there, raise "
        "the file size limit (ulimit -f) or pass --bundles DIR on another disk"
    )
    assert rc == 1 and "Traceback" not in err, err
    report = json.loads(out)
    assert report["error"].startswith(expected) and report["error"].endswith(tail), report
    assert [t["status"] for t in report["targets"]] == ["failed"]
    assert snapshot(project / "bundles") == before
    assert [p.name for p in staging_root(project / "bundles").iterdir()] == ["locks"]


# --- 8. FIFOs are refused without blocking -------------------------------------------------------


@pytest.mark.parametrize("field", ["content_files", "tools_file", "template.file"])
def test_fifo_in_a_definition_is_refused_without_hanging(
    tmp_path: Path, tiny_model: Path, field: str
):
    fifo = tmp_path / "prefixes" / "fold" / "pipe"
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    messages = {
        "content_files": '[[prefix.messages]]\nrole = "system"\ncontent_files = ["fold/pipe"]\n',
        "tools_file": f'[prefix]\ntools_file = "fold/pipe"\n\n{SYSTEM_ONLY}',
        "template.file": SYSTEM_ONLY,
    }[field]
    file = "fold/pipe" if field == "template.file" else "fold/template.jinja"
    path = file_template_definition(tmp_path, tiny_model, "{{ bos_token }}", messages, file=file)
    where = {"content_files": "prefix.messages.0.content_files", "tools_file": "prefix.tools_file"}
    with pytest.raises(DefinitionError) as exc:
        no_hang(lambda: load_definition(path, tmp_path))
    assert str(exc.value) == (
        f"{path}: {where.get(field, field)}: included file 'fold/pipe' is a FIFO, not a regular "
        "file; paths are relative to the definition's folder and must name regular UTF-8 text files"
    )


def test_verify_with_a_fifo_chat_template_is_one_line(
    tmp_path: Path, shop_bundle: Path, tiny_model: Path, capsys
):
    fifo = tmp_path / "template.jinja"
    os.mkfifo(fifo)
    argv = ["verify", str(shop_bundle), "--model", str(tiny_model), "--chat-template", str(fifo)]
    line = one_error(capsys, no_hang(lambda: main(argv)))
    assert line == (
        f"error: --chat-template {fifo}: is a FIFO, not a regular file; pass a template file"
    )


# --- 9. the model's context; the prefill's size and ETA on stderr --------------------------------


def test_prefix_longer_than_the_models_context_is_refused(tmp_path: Path, tiny_model: Path):
    model = copy_model(tiny_model, tmp_path / "models" / "tiny")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    path = write_definition(tmp_path, model)
    calls: list = []
    with pytest.raises(BuildError) as exc:
        build_bundle(tmp_path, progress=lambda *a: calls.append(a))
    message = str(exc.value)
    assert message.startswith(f"{path}: the prefix is ")
    assert message.endswith(
        " tokens but the model's context is 64 (max_position_embeddings); "
        "shorten the included documents or split the prefix"
    )
    assert int(message.split("the prefix is ")[1].split(" ")[0].replace(",", "")) > 64
    assert calls == []
    assert snapshot(tmp_path / "bundles") == {}


def test_build_prints_the_prefill_size_then_an_eta_after_the_first_chunk(
    tmp_path: Path, tiny_model: Path, capsys
):
    write_definition(tmp_path, tiny_model, prefill_step_size=16)
    assert cli(tmp_path, "build", "--no-check") == 0
    err = capsys.readouterr().err.splitlines()
    (bundle,) = (tmp_path / "bundles/shop/1").iterdir()
    count = json.loads((bundle / MANIFEST_FILE).read_text())["tokens"]["count"]
    assert count > 2 * 16
    progress = [line for line in err if line.startswith("shop@1 -> tiny: prefill ")]
    assert progress[0] == f"shop@1 -> tiny: prefill {count} tokens"
    first = progress[1]
    assert first.startswith(f"shop@1 -> tiny: prefill 16/{count} tokens, ") and ", ETA " in first
    eta = float(first.rsplit("ETA ", 1)[1].removesuffix("s"))
    assert 0 <= eta < 3600  # an estimate from the first chunk's rate, not a division by zero
    assert progress[-1].startswith(f"shop@1 -> tiny: prefill {count}/{count} tokens, ")


@pytest.mark.parametrize(
    ("arch", "group", "message"),
    [
        (None, 128, "cache.kv_group_size 128 does not divide the model's head_dim 64; set cache.kv_group_size to 32 or 64"),
        ("lfm2", 32, "head_dim 16; KV quantization needs a head_dim divisible by 32: remove cache.kv_bits"),
    ],
)  # fmt: skip
def test_a_group_size_the_model_cannot_take_is_refused_before_the_prefill(
    tmp_path: Path, tiny_model: Path, arch: str | None, group: int, message: str
):
    from pipeline.testmodels.arch import generate_arch_model

    model = generate_arch_model(tmp_path / "m", arch, tiny_model) if arch else tiny_model
    write_definition(tmp_path, model, kv_bits=8, kv_group_size=group)
    with pytest.raises(BuildError) as info:
        build_bundle(tmp_path)
    assert str(info.value).endswith(message)
    assert not (tmp_path / "bundles" / "shop").exists()
