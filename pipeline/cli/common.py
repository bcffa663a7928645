"""What every command shares: one-line errors, prefill progress, definitions, template files, JSON."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from pipeline.format.errors import PipelineError


def request_code_server(name: str) -> str:
    """argparse type of a --server whose own request code is called (match, new): a usage error
    for a name the format does not know or a server with no such code short of its app."""
    from pipeline.format.manifest import SERVER_NAMES
    from pipeline.runtime.servers.tokens import has_request_code, request_code_servers

    if name not in SERVER_NAMES or not has_request_code(name):
        why = " (its request code runs only inside its app)" if name in SERVER_NAMES else ""
        choices = ", ".join(request_code_servers())
        raise argparse.ArgumentTypeError(f"{name!r}{why}: choose one of {choices}")
    return name


def one_line(message: str) -> str:
    """The message on one line: a newline or other control character inside a name or path the
    user gave is shown escaped, never as a line break."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)


def program() -> str:
    """The command as the user typed it: `python build.py` in a checkout, else the installed
    `prefix-bundles` (what every library message names)."""
    argv0 = sys.argv[0] if sys.argv else ""
    return f"python {argv0}" if os.path.basename(argv0) == "build.py" else "prefix-bundles"


def invoked_as(message: str) -> str:
    """Every hint's `prefix-bundles COMMAND` as this process was invoked (one name per run)."""
    from pipeline.cli import USES_GLOBALS

    name = program()
    if name == "prefix-bundles":
        return message
    words = "|".join(sorted(map(re.escape, USES_GLOBALS), key=len, reverse=True))
    return re.sub(rf"(?<![\w/.-])prefix-bundles(?= (?:{words})\b)", name, message)


def shown(message: str) -> str:
    """A message as printed: one line (one_line), hints naming the command as invoked."""
    return invoked_as(one_line(message))


def say(line: str = "", file: TextIO | None = None, flush: bool = False) -> None:
    """One line of text output (stdout unless `file`): a path, a name or a manifest field in it
    is shown escaped (one_line), so one item stays one line, no terminal escape reaches the
    terminal, and a strict UTF-8 stdout never fails on a non-UTF-8 file name."""
    print(shown(line), file=file, flush=flush)


def err(message: str) -> None:
    """The one-line error every failure becomes."""
    print(f"error: {shown(message)}", file=sys.stderr)


def note(message: str) -> None:
    """A one-line note on stderr: something the command did that the user should know."""
    print(f"note: {shown(message)}", file=sys.stderr)


def warn(message: str) -> None:
    """A one-line warning on stderr (the command goes on)."""
    print(f"warning: {shown(message)}", file=sys.stderr)


def error_text(exc: Exception) -> str:
    """The one-line message of an expected failure (what `err` prints after 'error: ')."""
    if isinstance(exc, OSError):
        return f"{exc.filename or 'I/O'}: {exc.strerror or exc}"
    return str(exc)


def emit_json(document: Any) -> None:
    """One JSON document on stdout (sorted keys, trailing newline); logs stay on stderr."""
    has_dump = hasattr(document, "model_dump")
    data = document.model_dump(mode="json", by_alias=True) if has_dump else document
    print(json.dumps(data, indent=2, sort_keys=True))


def add_json_option(
    parser: argparse.ArgumentParser, schema: str, note: str = "", version: int = 1
) -> None:
    """The one --json option: a `<schema>/<version>` document on stdout instead of text (`note`
    adds)."""
    parser.add_argument(
        "--json",
        action="store_true",
        help=f"print one {schema}/{version} JSON document on stdout instead of text (its JSON "
        f"Schema: 'schema {schema}'); warnings and errors stay on stderr{note}",
    )


def emit(args: argparse.Namespace, report: Any, print_text: Callable[[Any], None]) -> None:
    """The report as JSON with --json, else as text."""
    if args.json:
        emit_json(report)
    else:
        print_text(report)


def progress(label: str, crossover: float | None = None):
    """Prefill progress on stderr: a rich bar on a terminal, else plain lines (CI logs).

    Plain lines: the size first, an ETA after the first chunk, then at most one every 0.5 s.
    Tokens reused from a parent are shown as reused; the rate counts prefilled tokens only. The
    ETA counts attention's growth with position (pipeline.cli.eta; `crossover`: its prior, from
    the model's config). A later phase (the fidelity check and its cold prefill, the self-check)
    is said as it starts, with the time so far (`report.phase`, called by the builder's
    announce), and its own prefill shows under its name with an ETA of its own.
    """
    from pipeline.cli.eta import DEFAULT_CROSSOVER, PrefillEta

    stage = {"what": "prefill", "eta": PrefillEta(crossover or DEFAULT_CROSSOVER)}
    report = _bar(label, stage) if sys.stderr.isatty() else _lines(label, stage)
    started = time.perf_counter()

    def phase(name: str) -> None:
        stage.update(what=name.split(" (")[0], eta=PrefillEta(crossover or DEFAULT_CROSSOVER))
        said = f"{label}: {name}, {time.perf_counter() - started:.1f}s so far"
        say(said, file=sys.stderr, flush=True)

    report.phase = phase
    return report


def progress_text(
    done: int, total: int, elapsed: float, reused: int = 0, eta: float | None = None
) -> str:
    """'16/40 tokens, 1,600 tok/s, ETA 0.0s', or the size alone before the first chunk ran.

    `eta`: the seconds left as a cost model says; without one, tokens left at the rate so far.
    """
    of_them = f" ({reused:,} reused)" if reused else ""
    if done <= reused:  # nothing prefilled yet: no rate, so no ETA
        todo = f"{total - reused} of {total}" if reused else f"{total}"
        return f"{todo} tokens{of_them}"
    rate = (done - reused) / max(elapsed, 1e-9)
    if eta is None:
        eta = (total - done) / max(rate, 1e-9)
    return f"{done}/{total} tokens{of_them}, {rate:,.0f} tok/s, ETA {eta:.1f}s"


def _text(eta: Any, done: int, total: int, elapsed: float, reused: int) -> str:
    """The progress text, the ETA model told of this call first."""
    if eta is None:
        return progress_text(done, total, elapsed, reused)
    eta.update(done, elapsed)
    return progress_text(done, total, elapsed, reused, eta.remaining(total))


def _bar(label: str, stage: dict, console: Any = None):
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn

    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[text]}"))
    # no refresh thread: a failed prefill cannot leave a live display behind
    bar = Progress(*columns, console=console or Console(stderr=True), auto_refresh=False)
    task: list = []  # (the stage it shows, its task id)

    def report(done: int, total: int, elapsed: float, reused: int = 0) -> None:
        text = _text(stage["eta"], done, total, elapsed, reused)
        if not task or task[0][0] != stage["what"]:  # a new stage starts a bar of its own
            what = stage["what"]  # it starts at the reused tokens: not progress of this stage
            task[:] = [
                (what, bar.add_task(f"{label}: {what}", total=total, completed=done, text=text))
            ]
            bar.start()
        bar.update(task[0][1], completed=done, total=total, text=text, refresh=True)
        if done >= total:
            bar.stop()

    return report


def _lines(label: str, stage: dict):
    last: list[float | None] = [None]  # when the last rate line was printed

    def report(done: int, total: int, elapsed: float, reused: int = 0) -> None:
        now = time.perf_counter()
        first = done <= reused
        text = _text(stage["eta"], done, total, elapsed, reused)  # every chunk counts
        if not first and done < total and last[0] is not None and now - last[0] < 0.5:
            return
        last[0] = None if first else now
        say(f"{label}: {stage['what']} {text}", file=sys.stderr, flush=True)

    return report


def load_definitions(prefix_dir: Path, names: list[str]) -> list:
    """The named definitions (all when none are named); a warning for any *.toml in a subfolder."""
    from pipeline.builder.batch import select_definitions
    from pipeline.builder.definition import stray_definitions

    for stray in stray_definitions(prefix_dir):
        warn(f"{stray}: definitions in subfolders are not loaded; move it to {prefix_dir}/")
    return select_definitions(prefix_dir, names)


def read_template(path: Path | None) -> str | None:
    """The text of a --chat-template file (a regular UTF-8 file), or None."""
    if path is None:
        return None
    from pipeline.format.regular_files import FileProblem, read_text

    try:
        return read_text(Path(path), 16 << 20)
    except FileProblem as exc:
        raise PipelineError(f"--chat-template {path}: {exc}; pass a template file") from None


def integrity_identity(bundle: Path):
    """The identity a bundle records, for checking it without a model folder (list, inspect).

    When manifest.json cannot be read, a placeholder that is never compared: the validator then
    refuses at the files or checksums stage, before the identity stage, and says which.
    """
    from pipeline.format.bundle_folder import read_manifest
    from pipeline.format.errors import BundleError
    from pipeline.format.fingerprint import ModelIdentity, ModelShape
    from pipeline.format.validate import recorded_identity

    try:
        return recorded_identity(read_manifest(bundle, None, kind=None))  # either kind
    except BundleError:
        return ModelIdentity("", "", None, ModelShape(0, None, None, None, None, None))


def plural(count: int, noun: str) -> str:
    """'1 folder', '2 folders'."""
    return f"{count} {noun}{'' if count == 1 else 's'}"
