#!/usr/bin/env bash
# Make (once) the virtual environment rapid-mlx's tests run in (tests/test_servers_rapid.py):
#   tests/envs/make_rapid_env.sh [DEST]   (DEST defaults to .venv-rapid in the repo root)
# rapid-mlx 0.16.10 ships a package named vllm_mlx of its own, so it cannot share a venv with
# vllm-mlx; it pins mlx-lm <0.32. The installed command `prefix-bundles server-env rapid-mlx` makes
# it: rapid-mlx without its dependencies (torch, torchvision, opencv, mlx-vlm and mflux: its image,
# video and vision paths), plus what its text serving path imports, over this interpreter's
# packages. Quick when DEST already imports them. PYTHON picks the interpreter (default python3).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="${1:-$root/.venv-rapid}"
python="${PYTHON:-python3}"
start=$(date +%s)
# the registry's second venv group: the servers whose packages clash with the first's
read -r -a servers <<< "$(cd "$root" && "$python" -c \
  'from pipeline.runtime.servers.registry import venv_groups; print(*venv_groups()[1])')"
"$python" "$root/build.py" server-env "${servers[@]}" "$dest" --replace "${@:2}"
echo "$dest ready in $(( $(date +%s) - start )) s"
