#!/usr/bin/env bash
# Deploy prefix bundles next to a model, verify them there, then have the server remount them.
#
#   examples/deploy.sh BUNDLES MODEL [HOST] > verify.json
#
#   BUNDLES  a bundles folder holding <name>/<version>/<slug>-<fingerprint>/ bundles: `build`'s
#            output, or the release workflow's `prefix-bundles` artifact unpacked; or an OCI
#            repository, oci://HOST[:PORT]/NAMESPACE/NAME, that CI pushed them to: the target
#            then pulls them itself (only the blocks it lacks move; checked, published atomically)
#   MODEL    the model folder on the target: the one the server's --model names
#   HOST     an ssh destination (user@host); omitted: deploy on this machine
#
# Environment: PROJECT, this project's checkout on the target (default /opt/mlx-prefix-bundles);
# PYTHON, its interpreter (default $PROJECT/.venv/bin/python); SERVICE, the systemd unit to tell
# (default prefix-bundles-serve.service, see examples/prefix-bundles-serve.service; set it empty to
# tell none); ACTION, what to tell it: reload (default: the unit's ExecReload sends SIGHUP, serve
# remounts the bundles while it keeps serving, no cold start) or restart; SYSTEMCTL (default
# "sudo systemctl"). From a registry: LOCKFILE, a prefixes.lock on the target that `push
# --lockfile` recorded digests in (pull exactly those artifacts); registry credentials as `pull`
# reads them on the target (`docker login`, or PREFIX_BUNDLES_REGISTRY_USER/_PASSWORD).
#
# The bundles go to MODEL/prefix-bundles/, the folder `serve --model MODEL` mounts and
# `verify --model MODEL` checks when no bundle is named. stdout is verify's JSON report. A copy is
# made and verified beside it (MODEL/.prefix-bundles.next, hardlinked from the live folder so only
# changed files move) and only then swapped in by two renames: the live folder is never half
# copied, and a deploy stopped at any point (Ctrl-C, a lost ssh) leaves it as it was or whole (a
# run after one stopped between the renames puts the old folder back first). When verify refuses
# a bundle (exit 1), the live folder is untouched, the new copy is kept in
# MODEL/.prefix-bundles.failed for a look, and nothing is restarted.
set -euo pipefail

if [[ $# -lt 2 || $# -gt 3 ]]; then
  echo "usage: $0 BUNDLES MODEL [HOST] > verify.json" >&2
  exit 2
fi
bundles=${1%/}
model=${2%/}
host=${3:-}
project=${PROJECT:-/opt/mlx-prefix-bundles}
python=${PYTHON:-$project/.venv/bin/python}
service=${SERVICE-prefix-bundles-serve.service}
action=${ACTION:-reload}
if [[ $action != reload && $action != restart ]]; then
  echo "error: ACTION=$action; use reload (SIGHUP: serve remounts) or restart" >&2
  exit 2
fi
read -r -a systemctl <<< "${SYSTEMCTL:-sudo systemctl}"
live=$model/prefix-bundles
previous=$model/.prefix-bundles.previous
failed=$model/.prefix-bundles.failed
next=$model/.prefix-bundles.next

if [[ $bundles != oci://* && ! -d $bundles ]]; then
  echo "error: $bundles is not a folder; pass a bundles folder (build output or the unpacked" \
    "artifact) or an oci://HOST/NAMESPACE/NAME registry repository" >&2
  exit 2
fi

# Run a command on the target: over ssh (each argument quoted for the remote shell) or here.
on_target() {
  if [[ -n $host ]]; then
    ssh -- "$host" "$(printf '%q ' "$@")"
  else
    "$@"
  fi
}

log() { echo "deploy: $*" >&2; }

# A run stopped between the swap's two renames left no live folder: the old one comes back first.
on_target bash -c 'if [[ ! -e $1 && -d $2 ]]; then mv -- "$2" "$1"; fi' _ "$live" "$previous"
on_target rm -rf "$previous" "$failed" "$next"
on_target mkdir -p "$live"

if [[ $bundles != oci://* ]]; then
  # the new copy, beside the live folder: hardlinked from it (no data copied; rsync replaces files
  # by renaming new ones into place, so the live folder keeps its contents), then verified
  on_target cp -al "$live" "$next"
  log "copying $bundles/ to ${host:+$host:}$next/"
  rsync -a --delete --exclude=.staging/ "$bundles/" "${host:+$host:}$next/"
  log "verifying every bundle in $next against $model"
  if ! on_target "$python" "$project/build.py" verify --json --model "$model" --bundles "$next"; then
    on_target mv "$next" "$failed"
    echo "error: verify refused a bundle (see the error lines above); $live is as it was, the" \
      "refused copy is in $failed; the server was not told" >&2
    exit 1
  fi
  on_target mv "$live" "$previous"
  on_target mv "$next" "$live"
  on_target rm -rf "$previous"
else
  # pull publishes each bundle atomically into the live folder; the rollback is a hardlinked
  # snapshot of what is deployed now
  on_target cp -al "$live" "$previous"
  log "pulling from $bundles into ${host:+$host:}$live/"
  if [[ -n ${LOCKFILE:-} ]]; then
    pull() { on_target "$python" "$project/build.py" pull --repo "$bundles" --model "$model" --lockfile "$LOCKFILE" >&2; }
  else
    pull() { on_target "$python" "$project/build.py" pull --repo "$bundles" --model "$model" >&2; }
  fi
  if ! pull; then
    on_target rm -rf "$previous"
    echo "error: pull failed (see the error line above); nothing was published, $live is as it" \
      "was; the server was not told" >&2
    exit 1
  fi
  log "verifying every bundle in $live against $model"
  if ! on_target "$python" "$project/build.py" verify --json --model "$model"; then
    on_target mv "$live" "$failed"
    on_target mv "$previous" "$live"
    echo "error: verify refused a bundle (see the error lines above); $live is back as it was," \
      "the refused copy is in $failed; the server was not told" >&2
    exit 1
  fi
  on_target rm -rf "$previous"
fi

if [[ -n $service ]]; then
  log "$action $service"
  on_target "${systemctl[@]}" "$action" "$service"
  sleep 5 # serve --strict exits when a bundle is refused or none is mounted
  if ! on_target "${systemctl[@]}" is-active --quiet "$service"; then
    echo "error: $service is not running after the $action; see journalctl -u $service" >&2
    exit 1
  fi
fi
log "done"
