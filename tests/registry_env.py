"""A real OCI registry on loopback for the tests: Debian's `docker-registry` (distribution 2.8.2).

`registry()` starts `/usr/bin/docker-registry serve CONFIG` on a free 127.0.0.1 port with a
temporary filesystem storage folder (and, given users, bcrypt htpasswd basic auth written with
apache2-utils' `htpasswd -B`), waits until `/v2/` answers, and stops it by its PID. Skipped where
the binary is absent, failed in CI (CI=true), where .ci/run installs it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from servers_env import free_port

BINARY = "/usr/bin/docker-registry"
HTPASSWD = "/usr/bin/htpasswd"
INSTALL = "apt-get install -y docker-registry apache2-utils (.ci/run does)"


@dataclass(frozen=True)
class Registry:
    host: str  # 127.0.0.1:PORT
    storage: Path  # the filesystem driver's root folder
    pid: int
    ca: Path | None = None  # the CA that signed its certificate, when it speaks TLS

    def repo(self, name: str = "fleet/bundles") -> str:
        """The --repo value for a repository on this registry."""
        return f"oci://{self.host}/{name}"

    def blob_file(self, digest: str) -> Path:
        """Where the filesystem driver keeps a blob's bytes."""
        hexd = digest.split(":", 1)[1]
        return self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"

    def store_manifest(self, tag: str, body: bytes, name: str = "fleet/bundles") -> str:
        """Write a manifest into storage and point tag at it, as the registry itself would (a
        tampered store, or one that took what this registry's own PUT refuses)."""
        import hashlib

        hexd = hashlib.sha256(body).hexdigest()
        data = self.blob_file(f"sha256:{hexd}")
        data.parent.mkdir(parents=True, exist_ok=True)
        data.write_bytes(body)
        manifests = self.storage / "docker/registry/v2/repositories" / name / "_manifests"
        for link in (
            manifests / "revisions/sha256" / hexd / "link",
            manifests / "tags" / tag / "current/link",
            manifests / "tags" / tag / "index/sha256" / hexd / "link",
        ):
            link.parent.mkdir(parents=True, exist_ok=True)
            link.write_text(f"sha256:{hexd}")
        return f"sha256:{hexd}"

    def stored_bytes(self) -> int:
        """Bytes of every blob in storage (manifests included)."""
        blobs = self.storage / "docker/registry/v2/blobs"
        return sum(p.stat().st_size for p in blobs.rglob("data")) if blobs.exists() else 0


def require_tools(*tools: str) -> None:
    missing = [t for t in tools if not Path(t).exists()]
    if missing:
        why = f"{', '.join(missing)} missing: {INSTALL}"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)


def write_htpasswd(path: Path, users: dict[str, str]) -> None:
    """A bcrypt htpasswd file (the only hash distribution accepts)."""
    require_tools(HTPASSWD)
    path.write_text("")
    for user, password in users.items():
        subprocess.run(
            [HTPASSWD, "-B", "-b", str(path), user, password], check=True, capture_output=True
        )


def make_tls(folder: Path) -> tuple[Path, Path, Path]:
    """(CA certificate, server certificate for 127.0.0.1 signed by it, its key), PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    day = datetime.timedelta(days=1)

    def issue(subject: str, key, issuer, signer, ca: bool) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - day)
            .not_valid_after(now + day)
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            loopback = x509.IPAddress(ipaddress.ip_address("127.0.0.1"))
            builder = builder.add_extension(x509.SubjectAlternativeName([loopback]), False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test registry CA")])
    ca = issue("test registry CA", ca_key, ca_name, ca_key, True)
    cert = issue("127.0.0.1", key, ca_name, ca_key, False)
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / "ca.pem", folder / "registry.pem", folder / "registry.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


def write_config(
    folder: Path,
    port: int,
    users: dict[str, str] | None,
    token: TokenService | None = None,
    tls: tuple[Path, Path, Path] | None = None,
) -> Path:
    auth = ""
    if token:
        auth = (
            f"auth:\n  token:\n    realm: {token.realm}\n    service: {token.service}\n"
            f"    issuer: {token.issuer}\n    rootcertbundle: {token.cert}\n"
        )
    elif users:
        write_htpasswd(folder / "htpasswd", users)
        auth = f"auth:\n  htpasswd:\n    realm: test-realm\n    path: {folder / 'htpasswd'}\n"
    config = folder / "config.yml"
    config.write_text(
        "version: 0.1\n"
        "log:\n  level: warn\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {folder / 'storage'}\n"
        "  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
        + (f"  tls:\n    certificate: {tls[1]}\n    key: {tls[2]}\n" if tls else "")
        + auth
    )
    return config


def _wait_ready(host: str, process: subprocess.Popen, log: Path, ca: Path | None = None) -> None:
    import ssl

    scheme, context = (
        ("https", ssl.create_default_context(cafile=str(ca))) if ca else ("http", None)
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"docker-registry exited: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"{scheme}://{host}/v2/", timeout=1, context=context)
            return
        except urllib.error.HTTPError:
            return  # 401 with auth: it is up
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"docker-registry did not answer on {host}: {log.read_text()[-2000:]}")


@contextmanager
def registry(
    folder: Path,
    users: dict[str, str] | None = None,
    token: TokenService | None = None,
    tls: bool = False,
) -> Iterator[Registry]:
    """A running registry storing under folder/storage (basic auth for `users`, or bearer
    tokens from `token`; with `tls`, HTTPS only, its CA at Registry.ca); stopped (by its PID)
    on exit."""
    require_tools(BINARY)
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    certs = make_tls(folder / "tls") if tls else None
    config = write_config(folder, port, users, token, certs)
    log = folder / "registry.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [BINARY, "serve", str(config)], stdout=out, stderr=subprocess.STDOUT
        )
    host = f"127.0.0.1:{port}"
    try:
        _wait_ready(host, process, log, certs and certs[0])
        yield Registry(host, folder / "storage", process.pid, certs and certs[0])
    finally:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


class TokenService:
    """A Docker-style token service on loopback (what a registry's `auth: token` trusts): GET
    /token?service=..&scope=.. with basic credentials answers a JWT signed RS256 by a
    self-signed certificate (the registry's rootcertbundle, sent in the `x5c` header) granting
    what the scopes ask; wrong or no credentials get 401. Every request is recorded."""

    service, issuer = "test-registry", "test-token-issuer"

    def __init__(self, folder: Path, users: dict[str, str]) -> None:
        import datetime

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import NameOID

        self.users, self.requests = users, []
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test token issuer")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        folder.mkdir(parents=True, exist_ok=True)
        self.cert = folder / "token.crt"
        self.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self.der = cert.public_bytes(serialization.Encoding.DER)

    def jwt(self, user: str, scopes: list[str]) -> str:
        import base64
        import json
        import secrets

        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        def b64(data: bytes) -> str:
            return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

        access = []
        for scope in scopes:
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            access.append({"type": kind, "name": name, "actions": actions.split(",")})
        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [base64.b64encode(self.der).decode()]}
        claims = {"iss": self.issuer, "sub": user, "aud": self.service, "exp": now + 300,
                  "nbf": now - 10, "iat": now, "jti": secrets.token_hex(8), "access": access}  # fmt: skip
        signing = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
        signature = self.key.sign(signing.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing}.{b64(signature)}"

    @contextmanager
    def running(self) -> Iterator[TokenService]:
        import base64
        import http.server
        import json
        import threading
        import urllib.parse

        service = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
                scopes = [s for v in query.get("scope", []) for s in v.split(" ")]
                auth = self.headers.get("authorization", "")
                user, _, password = (
                    base64.b64decode(auth[6:]).decode().partition(":")
                    if auth.startswith("Basic ")
                    else ("", "", "")
                )
                service.requests.append((user, scopes))
                if not user or service.users.get(user) != password:
                    self.send_response(401)
                    self.end_headers()
                    return
                body = json.dumps({"token": service.jwt(user, scopes), "expires_in": 300})
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.realm = f"http://127.0.0.1:{server.server_address[1]}/token"
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            server.shutdown()
            server.server_close()


def corrupt(path: Path) -> None:
    """Flip the last byte of a stored blob (a tampered registry)."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.chmod(0o644)
    path.write_bytes(bytes(data))


__all__ = ["Registry", "TokenService", "corrupt", "registry"]
