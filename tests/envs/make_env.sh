#!/usr/bin/env bash
# Make (once) a virtual environment with another mlx-lm minor for the cross-version tests:
#   tests/envs/make_env.sh 0.31 [DEST]   (DEST defaults to .venv-mlx-lm-0.31 in the repo root)
#   tests/envs/make_env.sh other         (the supported minor python3 does not have; CI uses this)
# It sees the base interpreter's packages (--system-site-packages: mlx, transformers, numpy, ...),
# installs the latest patch of that mlx-lm minor over them and this project (editable; only the
# dependencies the outer packages lack), then proves the venv imports that minor and not the outer
# one. Quick when it already exists. PYTHON picks the interpreter (default python3).
set -euo pipefail
minor="${1:?usage: make_env.sh MINOR|other [DEST], e.g. make_env.sh 0.31}"
root="$(cd "$(dirname "$0")/../.." && pwd)"
python="${PYTHON:-python3}"
if [ "$minor" = other ]; then  # the supported minor that $python does not have
  minor=$("$python" -c 'from importlib.metadata import version as v; print("0.31" if v("mlx-lm").startswith("0.32.") else "0.32")')
fi
dest="${2:-$root/.venv-mlx-lm-$minor}"

check() {
  "$dest/bin/python" - "$minor" <<'PY'
import sys
from importlib import metadata

import mlx_lm

minor = sys.argv[1]
found = {mlx_lm.__version__, metadata.version("mlx-lm")}
if len(found) != 1 or not next(iter(found)).startswith(minor + "."):
    sys.exit(f"mlx-lm {sorted(found)} in the venv, expected {minor}.x")
import pipeline.runtime  # noqa: F401

print(f"mlx-lm {mlx_lm.__version__} at {mlx_lm.__file__}")
PY
}

if [ -x "$dest/bin/python" ] && check >/dev/null 2>&1; then
  check
  exit 0
fi
rm -rf "$dest"
start=$(date +%s)
"$python" -m venv --system-site-packages "$dest"
# one resolve: the minor's latest patch, and this project with whatever the outer one lacks
"$dest/bin/python" -m pip install -q --disable-pip-version-check "mlx-lm~=$minor.0" -e "$root"
check
echo "made $dest in $(( $(date +%s) - start )) s"
