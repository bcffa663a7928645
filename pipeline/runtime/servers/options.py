"""serve's options as one immutable value (`ServeOptions`), and the checks made before anything is
loaded: the server's own options (passed through), its address, the admin endpoint's. Every
problem is a PipelineError, one line, nothing loaded."""

from __future__ import annotations

import argparse
import importlib.util
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.format.errors import PipelineError, UsageError


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
    snapshot_budget: str | None = None  # as given (snapshots.snapshot_budget: 2 GiB if none)
    snapshot_every: str | None = None  # minutes, as given (checked by snapshots.every_seconds)

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, rest: list[str], argv: list[str], warm_up: bool
    ) -> ServeOptions:
        """serve's parsed command line; `warm_up`: the hook's default where none was given."""
        from pipeline.runtime.mount import model_bundles_dir

        given = lambda name, default=None: getattr(args, name, default)  # noqa: E731
        chosen = given("warm_up")
        return cls(
            server=given("server") or "mlx-lm",
            model=Path(args.model),
            bundles=Path(given("bundles") or model_bundles_dir(args.model)),
            rest=tuple(rest),
            argv=tuple(argv),
            warm_up=warm_up if chosen is None else bool(chosen),
            strict=bool(given("strict")),
            verify_full=bool(given("verify_full")),
            lockfile=given("lockfile"),
            trusted_keys=tuple(given("trusted_key") or ()),
            huge_pages=given("huge_pages", "off"),
            admin_port=given("admin_port"),
            admin_token_file=given("admin_token_file"),
            snapshots=given("snapshots"),
            snapshot_budget=given("snapshot_budget"),
            snapshot_every=given("snapshot_every"),
        )

    def passed(self, name: str) -> str | None:
        """The value of a server option passed through, if any."""
        return passed_option(list(self.rest), name)

    def to_json(self) -> str:
        """For a process the server spawns (mlx-openai-server's model process)."""
        return json.dumps(asdict(self), default=str)

    @classmethod
    def from_json(cls, text: str) -> ServeOptions:
        values = json.loads(text)
        for name in ("model", "bundles", "lockfile", "admin_token_file", "snapshots"):
            values[name] = None if values[name] is None else Path(values[name])
        values["trusted_keys"] = tuple(Path(p) for p in values["trusted_keys"])
        values["rest"], values["argv"] = tuple(values["rest"]), tuple(values["argv"])
        return cls(**values)


def passed_option(rest: list[str], name: str) -> str | None:
    """The value of a server option passed through (`--name V` or `--name=V`), if any."""
    for i, arg in enumerate(rest):
        if arg == name and i + 1 < len(rest):
            return rest[i + 1] or None
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1] or None
    return None


# every server option serve reads (to check bundles, ports, the warm-up against it) besides
# those a hook refuses: spelled out, since argparse-based servers take any unambiguous prefix
READ_OPTIONS = (
    "--adapter-path", "--api-key", "--chat-template", "--chat-template-file",
    "--continuous-batching", "--draft-model", "--enable-mtp", "--host", "--kv-bits",
    "--log-level", "--max-kv-size", "--port", "--served-model-name", "--specprefill-draft-model",
    "--workers",
)  # fmt: skip
# the servers' own options that begin one of those: exact options, never abbreviations
NOT_ABBREVIATIONS = frozenset({"--model", "--specprefill"})


def refuse_options(rest: list[str], server: str, options: dict[str, str]) -> None:
    """PipelineError for a passed-through server option this hook cannot honour, and for an
    abbreviation of one serve reads or refuses (the server would take `--kv-bit 4` as
    `--kv-bits 4` while serve checked the bundles against no --kv-bits)."""
    names = {*READ_OPTIONS, *options}
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
    from pipeline.runtime.servers import hook_for

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
    "READ_OPTIONS",
    "passed_option",
    "port_number",
    "refuse_options",
    "require",
]
