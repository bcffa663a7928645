"""What the build side and the runtime side agree on: bundle layout, manifest schema, fingerprints, errors."""
