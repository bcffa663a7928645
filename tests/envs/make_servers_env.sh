#!/usr/bin/env bash
# Make (once) the virtual environment the server tests run in (tests/test_servers_*.py):
#   tests/envs/make_servers_env.sh [DEST]   (DEST defaults to .venv-servers in the repo root)
# vllm-mlx 0.6.0, mlx-omni-server 0.5.3 and mlx-openai-server 1.8.1 all pin mlx-lm <0.32, so
# this venv has mlx-lm 0.31 over this interpreter's packages (--system-site-packages). Each server
# is installed without its dependencies (vllm-mlx's pull in CUDA torch, 6.6 GB; omni's and
# mlx-openai-server's fail on Linux: mflux needs a CUDA mlx), plus what their serving paths import
# (mlx-openai-server's handler imports outlines, which imports torch: the CPU torch 2.13.0 wheel).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="${1:-$root/.venv-servers}"
python="${PYTHON:-python3}"
servers=(vllm-mlx==0.6.0 mlx-omni-server==0.5.3 mlx-openai-server==1.8.1)
# what vllm-mlx's serve path, omni's chat path and mlx-openai-server's handler import
serving=(fastapi uvicorn "starlette>=1.0.1" python-multipart psutil prometheus-client
         loguru "openai>=2.21,<3" openai-harmony "dill>=0.4,<0.5" "xxhash>=3.6,<4"
         "outlines>=1.1.1,<1.2" "torch==2.13.0")  # outlines imports torch: the CPU wheel

check() {
  "$dest/bin/python" - <<'PY'
from importlib import metadata

import mlx_lm

assert mlx_lm.__version__.startswith("0.31."), mlx_lm.__version__
import app.handler.mlx_lm  # noqa: F401  (mlx-openai-server)
import app.utils.prompt_cache  # noqa: F401
from outlines.processors import JSONLogitsProcessor  # noqa: F401  (its handler's import)
import mlx_omni_server.chat.mlx.chat_generator  # noqa: F401
import vllm_mlx.cli  # noqa: F401
import vllm_mlx.server  # noqa: F401

import pipeline.runtime.servers  # noqa: F401

names = ("mlx-lm", "vllm-mlx", "mlx-omni-server", "mlx-openai-server")
print(", ".join(f"{n} {metadata.version(n)}" for n in names))
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
"${pip[@]}" "mlx-lm>=0.31.3,<0.32" "${serving[@]}"
"${pip[@]}" --no-deps "${servers[@]}"
"${pip[@]}" --no-deps -e "$root"
check
echo "made $dest in $(( $(date +%s) - start )) s"
