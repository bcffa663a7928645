"""serve's options as one immutable typed value (`ServeOptions`: paths, sizes and intervals parsed
once, here), and the checks made before anything is loaded: the server's own options (passed
through), its address, the admin endpoint's. Every problem is a PipelineError, one line, nothing
loaded."""

from __future__ import annotations

import argparse
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.format.errors import PipelineError, UsageError

_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


@dataclass(frozen=True)
class ServeOptions:
    """Everything serve was told, read once from the command line; nothing changes it after."""

    server: str
    model: Path
    bundles: Path  # default: <model>/prefix-bundles
    rest: tuple[str, ...]  # the server's own options, passed through
    argv: tuple[str, ...]  # serve's whole command line (re-executed for huge pages)
    warm_up: bool  # resolved: the user's choice, else the hook's default
    strict: bool = False
    verify_full: bool = False
    lockfile: Path | None = None
    trusted_keys: tuple[Path, ...] = ()
    huge_pages: str = "off"
    admin_port: int | None = None
    admin_token_file: Path | None = None
    snapshots: Path | None = None
    snapshot_budget: int | None = None  # bytes (DEFAULT_BUDGET with --snapshots; None without)
    bundle_memory: int | None = None  # bytes the bundles may hold in memory (None: every bundle)
    # the least seconds between two spills while serving (0: none, saved at a graceful stop only)
    snapshot_every: float | None = None

    def __post_init__(self) -> None:
        if self.snapshots is not None and self.snapshot_budget is None:  # the default, typed
            from pipeline.runtime.snapshots import DEFAULT_BUDGET

            object.__setattr__(self, "snapshot_budget", DEFAULT_BUDGET)
        if self.snapshots is not None and self.snapshot_every is None:
            from pipeline.runtime.snapshot_spill import DEFAULT_EVERY_S

            object.__setattr__(self, "snapshot_every", DEFAULT_EVERY_S)

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, rest: list[str], argv: list[str], hook: Any
    ) -> ServeOptions:
        """serve's parsed command line for `hook`'s server (its warm-up default where none was
        given); a bad size or interval is refused here, before anything loads."""
        from pipeline.runtime.mount import model_bundles_dir

        given = lambda name, default=None: getattr(args, name, default)  # noqa: E731
        chosen = given("warm_up")
        every = every_seconds(args, hook)  # refused before the budget, as serve always did
        return cls(
            server=hook.name,
            model=Path(args.model),
            bundles=Path(given("bundles") or model_bundles_dir(args.model)),
            rest=tuple(rest),
            argv=tuple(argv),
            warm_up=hook.warm_up if chosen is None else bool(chosen),
            strict=bool(given("strict")),
            verify_full=bool(given("verify_full")),
            lockfile=given("lockfile"),
            trusted_keys=tuple(given("trusted_key") or ()),
            huge_pages=given("huge_pages", "off"),
            admin_port=given("admin_port"),
            admin_token_file=given("admin_token_file"),
            snapshots=given("snapshots"),
            snapshot_budget=snapshot_budget(args),
            bundle_memory=bundle_memory(args),
            snapshot_every=every,
        )

    def passed(self, name: str) -> str | None:
        """The value of a server option passed through, if any."""
        return passed_option(list(self.rest), name)


def parse_size(text: str, option: str = "--snapshot-budget") -> int:
    """Bytes from '2GiB', '512MiB', '1048576'; PipelineError naming the option and value otherwise."""
    match = re.fullmatch(r"\s*([0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match[2].upper() if match else None
    if match is None or unit not in _UNITS:
        raise UsageError(
            f"{option} {text!r} is not a size; write bytes or a number with KiB, MiB, "
            "GiB or TiB (e.g. 2GiB)"
        )
    return int(match[1]) * _UNITS[unit]


def snapshot_budget(args: Any) -> int | None:
    """--snapshot-budget in bytes (DEFAULT_BUDGET when not given); None without --snapshots,
    where nothing is saved (a budget given then is refused, not ignored)."""
    text = getattr(args, "snapshot_budget", None)
    if getattr(args, "snapshots", None) is None:
        if text is not None:
            raise UsageError("--snapshot-budget needs --snapshots DIR (the folder it saves to)")
        return None
    from pipeline.runtime.snapshots import DEFAULT_BUDGET

    return DEFAULT_BUDGET if text is None else parse_size(text)


def bundle_memory(args: Any) -> int | None:
    """--bundle-memory in bytes: the most the mounted bundles hold in memory, the rest waiting
    on disk (None when not given: every bundle is held)."""
    text = getattr(args, "bundle_memory", None)
    return None if text is None else parse_size(text, "--bundle-memory")


def every_seconds(args: Any, hook: Any) -> float | None:
    """--snapshot-every MINUTES in seconds: the least time between two spills of the server's
    entries while it serves (every server; 0 or off: none, saved at a graceful stop only); the
    default (snapshot_spill.DEFAULT_EVERY_S) with --snapshots; None without --snapshots, where a
    value given is refused."""
    text = getattr(args, "snapshot_every", None)
    if getattr(args, "snapshots", None) is None:
        if text is not None:
            raise UsageError("--snapshot-every needs --snapshots DIR (the folder it spills to)")
        return None
    if text is None:
        from pipeline.runtime.snapshot_spill import DEFAULT_EVERY_S

        return DEFAULT_EVERY_S
    try:
        minutes = 0.0 if text.strip().lower() == "off" else float(text)
    except ValueError:
        minutes = -1.0
    if not 0 <= minutes < 1e6:
        raise UsageError(
            f"--snapshot-every {text!r} is not a number of minutes; pass a number of 0 or more "
            "(e.g. 5, or 0.5 for 30 seconds; 0 or off: no spill while serving)"
        )
    return minutes * 60


def passed_option(rest: list[str], name: str) -> str | None:
    """The value of a server option passed through (`--name V` or `--name=V`), if any."""
    for i, arg in enumerate(rest):
        if arg == name and i + 1 < len(rest):
            return rest[i + 1] or None
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1] or None
    return None


# the server options the start-up sequence itself reads (each hook adds its own `reads`): spelled
# out, since argparse-based servers take any unambiguous prefix
CORE_READS = ("--chat-template", "--host", "--log-level", "--port", "--served-model-name")


def read_options() -> frozenset[str]:
    """Every server option serve reads: the start-up's own and each listed hook's `reads`."""
    from pipeline.runtime.servers.registry import hook_class, names

    return frozenset(CORE_READS).union(*(hook_class(n).reads for n in names()))


# the servers' own options that begin one of those: exact options, never abbreviations
NOT_ABBREVIATIONS = frozenset({"--model", "--specprefill"})


def refuse_options(rest: list[str], server: str, options: dict[str, str]) -> None:
    """PipelineError for a passed-through server option this hook cannot honour, and for an
    abbreviation of one serve reads or refuses (the server would take `--kv-bit 4` as
    `--kv-bits 4` while serve checked the bundles against no --kv-bits)."""
    names = {*read_options(), *options}
    for arg in rest:
        flag = arg.split("=", 1)[0]
        if arg == "--":
            break
        if flag in names or flag in NOT_ABBREVIATIONS or not flag.startswith("--"):
            continue
        meant = sorted(n for n in names if n.startswith(flag) and len(flag) > 2)
        if meant:
            raise UsageError(
                f"serve --server {server}: {flag} abbreviates {' or '.join(meant)}, which serve "
                "reads to check the bundles against the server's options; spell it out"
            )
    for option, why in options.items():
        if any(a == option or a.startswith(option + "=") for a in rest):
            raise UsageError(f"serve --server {server}: {option} is not supported: {why}")


def install_hint(server: str) -> str:
    """How to get a server whose package this environment lacks: its own virtual environment
    (the wrapped servers pin mlx-lm 0.31), made by the command the package ships."""
    venv = f".venv-{server}"
    return (
        f"make its environment with 'prefix-bundles server-env {server} {venv}', then run "
        f"'{venv}/bin/prefix-bundles' there (docs/servers.md)"
    )


def require(module: str, server: str) -> None:
    """PipelineError unless the server's package is importable here."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        raise PipelineError(
            f"serve --server {server}: {server} is not installed in this Python environment "
            f"({module} cannot be imported); {install_hint(server)}"
        )


def port_number(option: str, text: object) -> int:
    """A TCP port a server can listen on and log as given: 1-65535 (0 would be a random port
    nobody is told; larger numbers wrap around in some servers' bind)."""
    try:
        port = int(str(text))
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise UsageError(
            f"{option} {str(text)[:40]!r} is not a port number; pass {option} N with N in "
            "1-65535 (nothing was loaded or mounted)"
        )
    return port


def check_admin(options: ServeOptions) -> None:
    """The admin endpoint's options, before anything is loaded: its port in range, free and not
    the server's, its token file usable."""
    from pipeline.runtime.admin import HOST, read_token

    if options.admin_token_file is not None:
        if options.admin_port is None:
            raise UsageError("--admin-token-file needs --admin-port N (the endpoint it guards)")
        read_token(options.admin_token_file)
    if options.admin_port is None:
        return
    import socket

    port = port_number("--admin-port", options.admin_port)
    taken, by = server_port(options)
    if port == taken:
        raise UsageError(
            f"--admin-port {port} is also the server's port ({by}); the two cannot share it: "
            "pass another --admin-port or --port (nothing was loaded or mounted)"
        )
    try:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((HOST, port))
    except OSError as exc:
        raise PipelineError(
            f"--admin-port {port}: cannot listen on {HOST}:{port} ({exc.strerror}); pass another "
            "port (nothing was loaded or mounted)"
        ) from None


def server_port(options: ServeOptions) -> tuple[int, str]:
    """The port the server listens on (its --port, else its hook's default), and which it is."""
    from pipeline.runtime.servers.registry import hook_for

    text = options.passed("--port")
    if text is not None:
        return port_number("--port", text), "--port"
    return hook_for(options.server).address[1], f"{options.server}'s default; no --port given"


def check_port(address: tuple[str, int], rest: list[str]) -> None:
    """PipelineError when the server's address cannot be bound, before any model is loaded or
    bundle mounted: a taken port then costs nothing and never leaves a second process behind."""
    import socket

    host, port = address  # the hook's ADDRESS: where its server binds by default
    host = passed_option(rest, "--host") or host
    text = passed_option(rest, "--port")
    port = port_number("--port", text) if text is not None else port
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
            probe.bind(address)
    except (OSError, IndexError, OverflowError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        raise PipelineError(
            f"cannot listen on {host}:{port} ({why}); stop the process using it or pass "
            "another --port (nothing was loaded or mounted)"
        ) from None


__all__ = [
    "ServeOptions",
    "check_admin",
    "install_hint",
    "check_port",
    "CORE_READS",
    "read_options",
    "every_seconds",
    "parse_size",
    "bundle_memory",
    "snapshot_budget",
    "passed_option",
    "port_number",
    "refuse_options",
    "require",
]
