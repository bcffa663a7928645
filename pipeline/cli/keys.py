"""Key options the commands share: --trusted-key (verify, inspect, pull, serve) and signing keys.

A secret key comes from a file, or (for CI secrets) from the environment variable
PREFIX_BUNDLES_SIGNING_KEY holding the key file's text. An encrypted key's password comes from
PREFIX_BUNDLES_KEY_PASSWORD, or is asked on the terminal.
"""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from pathlib import Path

from pipeline.format.errors import PipelineError

KEY_ENV = "PREFIX_BUNDLES_SIGNING_KEY"
PASSWORD_ENV = "PREFIX_BUNDLES_KEY_PASSWORD"
MAX_SECRET_KEY_BYTES = 4096


def add_trusted_key_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trusted-key",
        action="append",
        type=Path,
        default=[],
        metavar="FILE",
        help="a minisign public key (repeatable, for rotation): every bundle must then carry a "
        "valid manifest.json.minisig by one of them",
    )


def trusted_keys(args: argparse.Namespace) -> tuple:
    """The public keys of --trusted-key (empty when none was given)."""
    from pipeline.format.signature import read_trusted_keys

    return read_trusted_keys(getattr(args, "trusted_key", None) or [])


def password(prompt: str = "Password: ", new: bool = False) -> str:
    """The secret key's password: PREFIX_BUNDLES_KEY_PASSWORD, else asked on the terminal (`new`:
    for a key being made, which may also be made without one)."""
    if PASSWORD_ENV in os.environ:
        return os.environ[PASSWORD_ENV]
    if not sys.stdin.isatty():
        if new:
            raise PipelineError(
                f"no terminal can ask for the new key's password; set {PASSWORD_ENV}, or pass "
                "--unencrypted for a key without one (nothing was written)"
            )
        raise PipelineError(
            f"the secret key is encrypted and no terminal can ask for its password; set {PASSWORD_ENV}"
        )
    return getpass.getpass(prompt)


def load_secret_key(path: Path | None, option: str = "--key"):
    """The signing key from `path`, else from PREFIX_BUNDLES_SIGNING_KEY; PipelineError if neither."""
    from pipeline.format.regular_files import FileProblem, read_regular
    from pipeline.format.secret_key import parse_secret_key

    if path is not None:
        source = f"{option} {path}"
        try:
            text = read_regular(Path(path), MAX_SECRET_KEY_BYTES).decode("ascii", "replace")
        except FileProblem as exc:
            raise PipelineError(f"{source} {exc}; pass a minisign secret key file") from None
    elif os.environ.get(KEY_ENV):
        source, text = f"${KEY_ENV}", os.environ[KEY_ENV]
    else:
        raise PipelineError(
            f"no signing key: pass {option} FILE or set {KEY_ENV} to the secret key file's text"
        )
    try:
        return parse_secret_key(text, password)
    except ValueError as exc:
        raise PipelineError(
            f"{source} is not a usable minisign secret key ({exc}); pass the .key file that "
            "'prefix-bundles keygen' or 'minisign -G' wrote"
        ) from None
