#!/usr/bin/env bash
# Make (once) the virtual environment rapid-mlx's tests run in (tests/test_servers_rapid.py):
#   tests/envs/make_rapid_env.sh [DEST]   (DEST defaults to .venv-rapid in the repo root)
# rapid-mlx 0.16.10 ships a package named vllm_mlx of its own, so it cannot share a venv with
# vllm-mlx; it pins mlx-lm <0.32. Installed without its dependencies (torch, torchvision,
# opencv, mlx-vlm and mflux: its image, video and vision paths), plus what its text serving path
# imports, over this interpreter's packages (--system-site-packages: mlx, transformers).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="${1:-$root/.venv-rapid}"
python="${PYTHON:-python3}"
serving=("mlx-lm>=0.31.3,<0.32" fastapi uvicorn "starlette>=1.0.1" python-multipart psutil
         prometheus-client loguru "openai>=2.21,<3" openai-harmony tiktoken pyyaml tomli-w rich
         tabulate jsonschema referencing argcomplete websockets mcp "dill>=0.4,<0.5"
         "xxhash>=3.6,<4")

check() {
  "$dest/bin/python" - <<'PY'
from importlib import metadata

import mlx_lm

assert mlx_lm.__version__.startswith("0.31."), mlx_lm.__version__
import rapid_mlx.cli  # noqa: F401
import rapid_mlx.scheduler  # noqa: F401
import rapid_mlx.server  # noqa: F401

import pipeline.runtime.servers.rapid_mlx  # noqa: F401

print(", ".join(f"{n} {metadata.version(n)}" for n in ("mlx-lm", "rapid-mlx")))
PY
}

if [ -x "$dest/bin/python" ] && check >/dev/null 2>&1; then
  check
  exit 0
fi
rm -rf "$dest"
start=$(date +%s)
"$python" -m venv --system-site-packages "$dest"
pip=("$dest/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" "${serving[@]}"
"${pip[@]}" --no-deps "rapid-mlx==0.16.10"
"${pip[@]}" --no-deps -e "$root"
check
echo "made $dest in $(( $(date +%s) - start )) s"
