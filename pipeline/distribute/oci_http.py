"""The HTTP library the OCI client uses: httpx, as the installed huggingface_hub ships it.

huggingface_hub 1.x depends on `httpx`, 2.x on its successor `httpx2` (the same API); both are
maintained and one is always installed with this project. Imported when first needed (a TLS or
proxied registry, a token realm, a transport error): a plain-HTTP pull never needs it, and
importing it (with certifi and its trust store paths) cost ~30-45 ms of a pull's start.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def lib() -> Any:
    """The httpx module (httpx2 where installed)."""
    try:
        import httpx2 as httpx
    except ImportError:  # huggingface_hub 1.x
        import httpx  # type: ignore[no-redef]
    return httpx


def __getattr__(name: str) -> Any:
    if name == "httpx":  # `from pipeline.distribute.oci_http import httpx`
        return lib()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["lib"]  # and `httpx`, resolved on first use
