"""The HTTP library the OCI client uses: httpx, as the installed huggingface_hub ships it.

huggingface_hub 1.x depends on `httpx`, 2.x on its successor `httpx2` (the same API); both are
maintained and one is always installed with this project.
"""

from __future__ import annotations

try:
    import httpx2 as httpx
except ImportError:  # huggingface_hub 1.x
    import httpx  # type: ignore[no-redef]

__all__ = ["httpx"]
