"""The `--json` documents: one pydantic model per command's output, each with a versioned `schema`.

Every document is one JSON object on stdout whose `schema` field names the command and a version
("verify/1"). A version only grows by adding fields; removing or retyping one makes it "/2".
`prefix-bundles schema [COMMAND]` prints the JSON Schema of each (committed in docs/schemas/).
Every model is here, in one package: base.py (the strict base, Refusal), local.py, fleet.py (push, pull),
authoring.py (new, match), tools.py (keygen, sign, demo, server-env).
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from pipeline.cli.reports.authoring import MatchedBundle, MatchReport, NewReport
from pipeline.cli.reports.base import Refusal, Report, refusal_of
from pipeline.cli.reports.fleet import (
    PulledBundle,
    PullReport,
    PullTotals,
    PushedBundle,
    PushReport,
    PushTotals,
)
from pipeline.cli.reports.local import (
    BuildReport,
    BuildTotals,
    BuiltTarget,
    CheckResult,
    InspectReport,
    KeptFolder,
    ListedBundle,
    ListedDefinition,
    ListReport,
    ListTotals,
    PrunedFolder,
    PruneReport,
    PruneTotals,
    Shard,
    SignatureReport,
    Validity,
    VerifiedBundle,
    VerifyReport,
    VerifyTotals,
)
from pipeline.cli.reports.tools import (
    DemoBundle,
    DemoReport,
    KeygenReport,
    ServerEnvReport,
    SignedBundle,
    SignReport,
    SignTotals,
)
from pipeline.runtime.admin import BundlesReport, RemountReport

__all__ = [
    "BuildReport",
    "BuildTotals",
    "BuiltTarget",
    "CheckResult",
    "DOCUMENTS",
    "DemoBundle",
    "DemoReport",
    "InspectReport",
    "KeptFolder",
    "KeygenReport",
    "ListReport",
    "ListTotals",
    "ListedBundle",
    "ListedDefinition",
    "MatchReport",
    "MatchedBundle",
    "NewReport",
    "PruneReport",
    "PruneTotals",
    "PrunedFolder",
    "PullReport",
    "PullTotals",
    "PulledBundle",
    "PushReport",
    "PushTotals",
    "PushedBundle",
    "Refusal",
    "Report",
    "ServerEnvReport",
    "Shard",
    "SignReport",
    "SignTotals",
    "SignatureReport",
    "SignedBundle",
    "Validity",
    "VerifiedBundle",
    "VerifyReport",
    "VerifyTotals",
    "refusal_of",
    "schema_of",
    "schema_text",
]

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

DOCUMENTS: dict[str, type[BaseModel]] = {
    "build": BuildReport,
    "verify": VerifyReport,
    "inspect": InspectReport,
    "list": ListReport,
    "prune": PruneReport,
    "push": PushReport,
    "pull": PullReport,
    "match": MatchReport,
    "new": NewReport,
    "keygen": KeygenReport,
    "sign": SignReport,
    "demo": DemoReport,
    "server-env": ServerEnvReport,
    # serve --admin-port's answers (pipeline.runtime.admin)
    "remount": RemountReport,
    "bundles": BundlesReport,
}


def schema_of(command: str) -> dict:
    """The JSON Schema (draft 2020-12) of a command's `--json` document."""
    schema = DOCUMENTS[command].model_json_schema(by_alias=True, mode="serialization")
    return {"$schema": JSON_SCHEMA_DIALECT, **schema}


def schema_text(command: str) -> str:
    """The schema as committed in docs/schemas/<command>.json (sorted keys, trailing newline)."""
    return json.dumps(schema_of(command), indent=2, sort_keys=True) + "\n"
