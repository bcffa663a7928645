"""Run `build.py serve ...` unchanged, with every check-out of the one lookup rule recorded: one
JSON line per lookup in LOG, the tokens the server is told are cached and the K/V
offset of the cache it is handed to continue (tests/test_servers_own_entries.py). With
--cold every lookup answers cold: the same server as a reference that reuses nothing.

  checkout_driver.py LOG [--cold] [build.py options] serve --server NAME ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.cli import main  # noqa: E402
from pipeline.runtime.servers import entries, mounted  # noqa: E402

LOG = Path(sys.argv.pop(1))
COLD = sys.argv[1] == "--cold" and bool(sys.argv.pop(1))
original = mounted.lookup_source


def recorded(server, manager, key, tokens, fetch, batched, bundles=True):  # noqa: ANN001, ANN201
    if COLD:  # the reference: the same server, nothing reused through the rule
        cache, rest, from_bundle = None, list(tokens), False
    else:
        cache, rest, from_bundle = original(server, manager, key, tokens, fetch, batched, bundles)
    line = {
        "tokens": len(tokens),
        "cached": 0 if cache is None else len(tokens) - len(rest),
        "offset": None if cache is None else entries.held_offset(cache),
        "from_bundle": from_bundle,
    }
    with LOG.open("a") as out:
        out.write(json.dumps(line) + "\n")
    return cache, rest, from_bundle


mounted.lookup_source = recorded

if __name__ == "__main__":
    sys.exit(main())
