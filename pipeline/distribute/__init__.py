"""Fleet distribution: bundles pushed to a Hugging Face hub repo or an OCI registry (oci_push,
oci_pull: token-range blocks, only new bytes move) and pulled next to each model.

The repo holds the local layout, <name>/<version>/<slug>-<fingerprint[:12]>/, in a model repo.
Push validates every bundle's integrity before one commit; pull downloads only the bundles whose
folder names the local model's fingerprint, validates them against that model with the real
validator, and publishes them atomically. No printing here: pipeline.cli.push / pull do that.
"""

# Modules the CLI imports from.
__all__ = [
    "hub",
    "meter",
    "oci",
    "oci_pull",
    "oci_push",
    "prehash",
    "pull",
    "push",
]
