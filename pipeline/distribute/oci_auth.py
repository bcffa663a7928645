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
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipeline.distribute.oci_http import paced
from pipeline.distribute.untrusted import Unfit, may_carry_credentials, parse_as, read_capped
from pipeline.format.errors import PipelineError
from pipeline.format.regular_files import FileProblem, read_regular

USER_ENV = "PREFIX_BUNDLES_REGISTRY_USER"
PASSWORD_ENV = "PREFIX_BUNDLES_REGISTRY_PASSWORD"
MAX_REPLY_BYTES = 1 << 20  # a config file, a helper's or a token service's answer
HELPER_TIMEOUT_S = 30.0  # a credential helper waiting on a login or a keyring stops here
TOKEN = re.compile(r"^[\x21-\x7e]+\Z")  # a bearer token: visible ASCII, sent as a header value


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


class DockerAuth(BaseModel):
    """One `auths` entry of a Docker config file (the fields read here)."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    auth: str | None = None
    username: str | None = None
    password: str | None = None
    identitytoken: str | None = None


class DockerConfig(BaseModel):
    """A Docker config file: what it says about credentials; the rest is not read."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    auths: dict[str, DockerAuth] | None = None
    credHelpers: dict[str, str] | None = None  # noqa: N815 - Docker's field name
    credsStore: str | None = None  # noqa: N815


class HelperReply(BaseModel):
    """What `docker-credential-<helper> get` prints."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    Username: str = ""
    Secret: str = ""


class TokenReply(BaseModel):
    """A token service's answer (the distribution token spec: `token`, or OAuth2's name)."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    token: str | None = None
    access_token: str | None = None


def docker_config() -> tuple[Path, DockerConfig]:
    """(where the Docker config file is, what it says: empty when there is none)."""
    folder = os.environ.get("DOCKER_CONFIG") or str(Path.home() / ".docker")
    path = Path(folder) / "config.json"
    if not os.path.lexists(path):
        return path, DockerConfig()
    try:  # a FIFO or a device there is refused, never waited on or read without end
        data = read_regular(path, MAX_REPLY_BYTES)
    except FileProblem as exc:
        raise _config_error(path, str(exc)) from None
    try:
        return path, parse_as(DockerConfig, data, MAX_REPLY_BYTES)
    except Unfit as exc:
        raise _config_error(path, str(exc)) from None


def _config_error(path: Path, why: str) -> PipelineError:
    return PipelineError(
        f"{path}: cannot be read as a Docker config file ({why}); fix or remove it, or set "
        f"{USER_ENV} and {PASSWORD_ENV}"
    )


def _host_key(key: str) -> str:
    """A config key ('https://host/v1/', 'host') as the bare host[:port]."""
    return re.sub(r"^[a-z]+://", "", key).split("/", 1)[0]


def credentials(host: str) -> Creds | None:
    """The credentials for host, or None (anonymous)."""
    user, password = os.environ.get(USER_ENV), os.environ.get(PASSWORD_ENV)
    if user and password is not None:
        return Creds(user, password, f"${USER_ENV}")
    path, config = docker_config()
    helper = (config.credHelpers or {}).get(host) or config.credsStore
    if helper:
        found = _from_helper(helper, host)
        if found:
            return found
    for key, entry in (config.auths or {}).items():
        if _host_key(key) == host:
            return _from_entry(entry, f"{path}: auths[{key!r}]")
    return None


def _from_entry(entry: DockerAuth, where: str) -> Creds | None:
    if entry.identitytoken:
        return Creds("<token>", entry.identitytoken, "docker config identitytoken")
    if entry.auth:
        try:
            pair = base64.b64decode(entry.auth, validate=True).decode()
        except ValueError:  # binascii.Error, UnicodeDecodeError
            raise PipelineError(
                f"{where}: its `auth` is not base64 of user:password; log in again with 'docker "
                f"login', or set {USER_ENV} and {PASSWORD_ENV}"
            ) from None
        user, _, password = pair.partition(":")
        return Creds(user, password, "docker config auths")
    if entry.username:
        return Creds(entry.username, entry.password or "", "docker config auths")
    return None


def _from_helper(helper: str, host: str) -> Creds | None:
    """Ask `docker-credential-<helper> get`; None when it has nothing for host."""
    program = f"docker-credential-{helper}"
    try:
        out = subprocess.run(
            [program, "get"], input=host.encode(), capture_output=True, timeout=HELPER_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise PipelineError(
            f"the credential helper {program} (named by the Docker config for {host}) did not "
            f"answer within {HELPER_TIMEOUT_S:g} s; check it (it may be waiting for a login or a keyring), or set "
            f"{USER_ENV} and {PASSWORD_ENV}"
        ) from None
    except OSError:
        raise PipelineError(
            f"the Docker config names the credential helper {helper!r} for {host}, but "
            f"{program} cannot be run; install it or set {USER_ENV} and {PASSWORD_ENV}"
        ) from None
    if out.returncode != 0:
        return None
    try:
        reply = parse_as(HelperReply, out.stdout, MAX_REPLY_BYTES)
    except Unfit as exc:
        raise PipelineError(
            f"the credential helper {program} answered for {host} with no credentials JSON "
            f"({exc}); fix the helper, or set {USER_ENV} and {PASSWORD_ENV}"
        ) from None
    return Creds(reply.Username, reply.Secret, program)


def basic(creds: Creds) -> str:
    pair = f"{creds.username}:{creds.password}".encode()
    return "Basic " + base64.b64encode(pair).decode()


def auth_header(
    client: Any, challenge: Challenge, creds: Creds | None, ref: Any, doing: str, base: str
) -> dict[str, str] | None:
    """The Authorization header answering a challenge of the registry at `base`, or None when
    it cannot be answered."""
    if challenge.scheme == "basic":
        return {"authorization": basic(creds)} if creds else None
    if challenge.scheme != "bearer" or "realm" not in challenge.params:
        return None
    # one `scope` parameter per scope, as Docker sends them (a challenge lists them spaced)
    scopes = challenge.params.get("scope", f"repository:{ref.name}:pull,push").split()
    params = [("scope", s) for s in scopes]
    if "service" in challenge.params:
        params.insert(0, ("service", challenge.params["service"]))
    realm = challenge.params["realm"]
    where = f"registry {ref.host}: {doing}: the token service {' '.join(realm.split())[:120]}"
    if creds and not may_carry_credentials(realm, base):
        raise PipelineError(
            f"{where} is plain HTTP on another origin: the credentials for {ref.host} are not "
            "sent there in clear; have the registry name an https:// token service"
        )
    headers = {"authorization": basic(creds)} if creds else {}
    try:
        with client.stream("GET", realm, params=params, headers=headers) as r:
            if r.status_code != 200:
                return None  # the caller reports the registry's 401
            data = read_capped(paced(r.iter_bytes(), MAX_REPLY_BYTES), MAX_REPLY_BYTES)
    except Exception as exc:
        raise PipelineError(
            f"{where} did not answer ({exc.__class__.__name__}); check it and retry"
        ) from None
    try:
        reply = parse_as(TokenReply, data, MAX_REPLY_BYTES)
    except Unfit as exc:
        raise PipelineError(
            f"{where} answered with no token ({exc}); check that it is the registry's token "
            "service, then retry"
        ) from None
    token = reply.token or reply.access_token
    if token and not TOKEN.match(token):
        raise PipelineError(
            f"{where} answered with a token that cannot be sent in a header (spaces or control "
            "characters); check that it is the registry's token service, then retry"
        )
    return {"authorization": f"Bearer {token}"} if token else None
