#!/usr/bin/env bash
# Make (once) the virtual environment the server tests run in (tests/test_servers_*.py):
#   tests/envs/make_servers_env.sh [DEST]   (DEST defaults to .venv-servers in the repo root)
# vllm-mlx 0.6.0, mlx-omni-server 0.5.3 and mlx-openai-server 1.8.1 all pin mlx-lm <0.32: the
# installed command `prefix-bundles server-env` makes the venv (mlx-lm 0.31 over this
# interpreter's packages, each server without its dependencies plus what its serving path imports,
# this project; pins declared by each server's hook). Quick when DEST already imports them.
# PYTHON picks the interpreter (default python3); `--dry-run` after DEST prints the commands.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="${1:-$root/.venv-servers}"
python="${PYTHON:-python3}"
start=$(date +%s)
# the servers are the registry's first venv group (pipeline/runtime/servers/registry.py)
read -r -a servers <<< "$(cd "$root" && "$python" -c \
  'from pipeline.runtime.servers.registry import venv_groups; print(*venv_groups()[0])')"
"$python" "$root/build.py" server-env "${servers[@]}" "$dest" --replace "${@:2}"
echo "$dest ready in $(( $(date +%s) - start )) s"
