#!/usr/bin/env python3
"""`python build.py <command>`: build, verify, inspect and serve MLX prefix-cache bundles."""

import sys

from pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main())
