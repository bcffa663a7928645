"""What the build side and the runtime side agree on: bundle layout, manifest schema, fingerprints, errors."""

# Public modules: the builder, the runtime, distribute and the CLI import from each.
__all__ = [
    "block_proof",
    "bundle_folder",
    "bundle_signature",
    "bundle_writer",
    "cache_blocks",
    "cache_codec",
    "cache_header",
    "cache_state",
    "compat",
    "errors",
    "fingerprint",
    "identity",
    "lockfile",
    "manifest",
    "memo",
    "names",
    "regular_files",
    "safe_files",
    "safe_tree",
    "safetensors_read",
    "secret_key",
    "served_identity",
    "signature",
    "validate",
]
