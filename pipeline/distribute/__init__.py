"""Fleet distribution: bundles pushed to a Hugging Face hub repo or an OCI registry (oci_push,
oci_pull: token-range blocks, only new bytes move) and pulled next to each model.

The repo holds the local layout, <name>/<version>/<slug>-<fingerprint[:12]>/, in a model repo.
Push validates every bundle's integrity before one commit; pull downloads only the bundles whose
folder names the local model's fingerprint, validates them against that model with the real
validator, and publishes them atomically. No printing here: pipeline.cli.push / pull do that.
"""

# Modules the CLI imports from. In layers: the OCI protocol (oci, oci_http, oci_auth, oci_tags),
# the artifact's bytes (artifact, blocks), the workflow both back ends share (checked: what a push
# starts from; selection and publish: what a pull takes and how it ends) and the two back ends,
# hub (hub, push, pull) and OCI (oci_push, oci_pull), which never import each other.
__all__ = [
    "checked",
    "hub",
    "meter",
    "oci",
    "oci_pull",
    "oci_push",
    "prehash",
    "publish",
    "pull",
    "push",
    "selection",
]
