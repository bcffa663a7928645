"""--admin-token-file: the admin endpoint's bearer token, read from a file only its user can read
and read again whenever the file changes (pipeline.runtime.admin asks `TokenFile.current` per
request)."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

from pipeline.format.errors import PipelineError
from pipeline.format.memo import file_identity  # size, times, inode: a chmod changes ctime
from pipeline.format.regular_files import FileProblem, read_text

TOKEN_BYTES = 4096  # a token file larger than this is not one (/dev/zero is refused unread)


class TokenFile:
    """--admin-token-file's token, read again whenever the file changes (a rotated token takes
    over; a deleted or unusable file refuses every request, never keeping the old token)."""

    def __init__(self, path: Path) -> None:
        self.path, self.lock = path, threading.Lock()
        self.key, self.token = read_token_file(path)

    def current(self) -> str:
        """The token the file holds now; PipelineError when it is gone or unusable."""
        with self.lock:
            try:
                changed = file_identity(os.stat(self.path)) != self.key
            except OSError:
                changed = True  # read_token_file says why
            if changed:
                self.key, self.token = read_token_file(self.path)
            return self.token


def read_token_file(path: Path) -> tuple[tuple[int, ...], str]:
    """The token file's stat key and its token (the first line): a regular file of this user that
    only they can read, printable ASCII; PipelineError naming the file and the fix otherwise."""
    fix = "write one line of at least 16 printable ASCII characters to a file only you can read"
    try:
        st = os.stat(path)  # before the read: a file replaced meanwhile is read again next time
        text = read_text(path, TOKEN_BYTES)  # never blocks on a FIFO, never reads /dev/zero
    except FileNotFoundError:
        text, why = None, "does not exist"
    except OSError as exc:
        text, why = None, f"cannot be read ({exc.strerror})"
    except FileProblem as exc:
        text, why = None, str(exc)
    if text is None:
        raise PipelineError(f"--admin-token-file {path}: cannot read a token: it {why}; {fix}")
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise PipelineError(
            f"--admin-token-file {path} is open to other users or not yours (mode "
            f"{stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}); the token guards the admin "
            f"endpoint: use a file of your own and fix it with 'chmod 600 {path}'"
        )
    token = (text.strip().splitlines() or [""])[0].strip()
    if not (token.isascii() and token.isprintable()):
        raise PipelineError(
            f"--admin-token-file {path}: the token is not printable ASCII (an HTTP header "
            f"cannot carry it); {fix}"
        )
    if len(token) < 16:
        raise PipelineError(
            f"--admin-token-file {path}: the token is {len(token)} characters; use at least 16"
        )
    return file_identity(st), token


def read_token(path: Path | None) -> TokenFile | None:
    """The admin token file, checked now (PipelineError naming it when unusable) and read again
    whenever it changes."""
    return None if path is None else TokenFile(Path(path))


__all__ = ["TokenFile", "read_token"]
