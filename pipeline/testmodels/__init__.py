"""Deterministic real-format model folders the project generates itself (no hub needed)."""
