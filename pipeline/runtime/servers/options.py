"""The options serve checks before anything is loaded: the server's own (passed through), its
address, and the admin endpoint's. Every problem is a PipelineError, one line, nothing loaded."""

from __future__ import annotations

import argparse
import importlib.util

from pipeline.format.errors import PipelineError


def passed_option(rest: list[str], name: str) -> str | None:
    """The value of a server option passed through (`--name V` or `--name=V`), if any."""
    for i, arg in enumerate(rest):
        if arg == name and i + 1 < len(rest):
            return rest[i + 1] or None
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1] or None
    return None


def refuse_options(rest: list[str], server: str, options: dict[str, str]) -> None:
    """PipelineError for a passed-through server option this hook cannot honour."""
    for option, why in options.items():
        if any(a == option or a.startswith(option + "=") for a in rest):
            raise PipelineError(f"serve --server {server}: {option} is not supported: {why}")


def require(module: str, server: str) -> None:
    """PipelineError unless the server's package is importable here."""
    if importlib.util.find_spec(module) is None:
        raise PipelineError(
            f"serve --server {server}: {server} is not installed in this Python environment "
            f"({module} cannot be imported); install it with "
            f"\"pip install 'mlx-prefix-bundles[{server}]'\" (docs/servers.md)"
        )


def port_number(option: str, text: object) -> int:
    """A TCP port a server can listen on and log as given: 1-65535 (0 would be a random port
    nobody is told; larger numbers wrap around in some servers' bind)."""
    try:
        port = int(str(text))
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise PipelineError(
            f"{option} {str(text)[:40]!r} is not a port number; pass {option} N with N in "
            "1-65535 (nothing was loaded or mounted)"
        )
    return port


def check_admin(args: argparse.Namespace) -> None:
    """The admin endpoint's options, before anything is loaded: its port in range and free,
    its token file readable."""
    from pipeline.runtime.admin import HOST, read_token

    if getattr(args, "admin_token_file", None) is not None:
        if getattr(args, "admin_port", None) is None:
            raise PipelineError("--admin-token-file needs --admin-port N (the endpoint it guards)")
        read_token(args.admin_token_file)
    if getattr(args, "admin_port", None) is None:
        return
    import socket

    port = port_number("--admin-port", args.admin_port)
    try:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((HOST, port))
    except OSError as exc:
        raise PipelineError(
            f"--admin-port {port}: cannot listen on {HOST}:{port} ({exc.strerror}); pass another "
            "port (nothing was loaded or mounted)"
        ) from None


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


__all__ = ["check_admin", "check_port", "passed_option", "port_number", "refuse_options", "require"]
