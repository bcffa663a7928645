"""Registry credentials, read where Docker and ORAS read them, and the 401 challenge they answer.

Credentials for a host: PREFIX_BUNDLES_REGISTRY_USER / PREFIX_BUNDLES_REGISTRY_PASSWORD, else the
Docker config file ($DOCKER_CONFIG/config.json or ~/.docker/config.json): its `credHelpers` entry
for the host or its `credsStore` (the `docker-credential-<helper> get` program), else `auths`
(`auth`, base64 user:password, or `username`/`password`, or an `identitytoken`). A `Basic`
challenge is answered with them; a `Bearer` challenge by fetching a token from its realm (with
them, when any) for the scope it names.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.format.errors import PipelineError

USER_ENV = "PREFIX_BUNDLES_REGISTRY_USER"
PASSWORD_ENV = "PREFIX_BUNDLES_REGISTRY_PASSWORD"


@dataclass(frozen=True)
class Creds:
    username: str
    password: str  # an identity token when username is "<token>"
    source: str  # where they came from, for messages (never the secret)


@dataclass(frozen=True)
class Challenge:
    scheme: str  # "basic", "bearer" or "" (none given)
    params: dict[str, str]

    @classmethod
    def parse(cls, header: str) -> Challenge:
        scheme, _, rest = header.strip().partition(" ")
        params = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        return cls(scheme.lower(), params)


def docker_config() -> dict[str, Any]:
    folder = os.environ.get("DOCKER_CONFIG") or str(Path.home() / ".docker")
    path = Path(folder) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise PipelineError(
            f"{path}: cannot be read as a Docker config file ({exc.__class__.__name__}); fix or "
            f"remove it, or set {USER_ENV} and {PASSWORD_ENV}"
        ) from None


def _host_key(key: str) -> str:
    """A config key ('https://host/v1/', 'host') as the bare host[:port]."""
    return re.sub(r"^[a-z]+://", "", key).split("/", 1)[0]


def credentials(host: str) -> Creds | None:
    """The credentials for host, or None (anonymous)."""
    user, password = os.environ.get(USER_ENV), os.environ.get(PASSWORD_ENV)
    if user and password is not None:
        return Creds(user, password, f"${USER_ENV}")
    config = docker_config()
    helper = (config.get("credHelpers") or {}).get(host) or config.get("credsStore")
    if helper:
        found = _from_helper(helper, host)
        if found:
            return found
    for key, entry in (config.get("auths") or {}).items():
        if _host_key(key) == host and isinstance(entry, dict):
            return _from_entry(entry)
    return None


def _from_entry(entry: dict[str, Any]) -> Creds | None:
    if entry.get("identitytoken"):
        return Creds("<token>", entry["identitytoken"], "docker config identitytoken")
    if entry.get("auth"):
        user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
        return Creds(user, password, "docker config auths")
    if entry.get("username"):
        return Creds(entry["username"], entry.get("password", ""), "docker config auths")
    return None


def _from_helper(helper: str, host: str) -> Creds | None:
    """Ask `docker-credential-<helper> get`; None when it has nothing for host."""
    program = f"docker-credential-{helper}"
    try:
        out = subprocess.run(
            [program, "get"], input=host, capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        raise PipelineError(
            f"the Docker config names the credential helper {helper!r} for {host}, but "
            f"{program} cannot be run; install it or set {USER_ENV} and {PASSWORD_ENV}"
        ) from None
    if out.returncode != 0:
        return None
    data = json.loads(out.stdout)
    return Creds(data.get("Username", ""), data.get("Secret", ""), program)


def basic(creds: Creds) -> str:
    pair = f"{creds.username}:{creds.password}".encode()
    return "Basic " + base64.b64encode(pair).decode()


def auth_header(
    client: Any, challenge: Challenge, creds: Creds | None, ref: Any, doing: str
) -> dict[str, str] | None:
    """The Authorization header answering a challenge, or None when it cannot be answered."""
    if challenge.scheme == "basic":
        return {"authorization": basic(creds)} if creds else None
    if challenge.scheme != "bearer" or "realm" not in challenge.params:
        return None
    # one `scope` parameter per scope, as Docker sends them (a challenge lists them spaced)
    scopes = challenge.params.get("scope", f"repository:{ref.name}:pull,push").split()
    params = [("scope", s) for s in scopes]
    if "service" in challenge.params:
        params.insert(0, ("service", challenge.params["service"]))
    headers = {"authorization": basic(creds)} if creds else {}
    try:
        r = client.get(challenge.params["realm"], params=params, headers=headers)
    except Exception as exc:
        raise PipelineError(
            f"registry {ref.host}: {doing}: the token service {challenge.params['realm']} did "
            f"not answer ({exc.__class__.__name__}); check it and retry"
        ) from None
    if r.status_code != 200:
        return None  # the caller reports the registry's 401
    body = r.json()
    token = body.get("token") or body.get("access_token")
    return {"authorization": f"Bearer {token}"} if token else None
