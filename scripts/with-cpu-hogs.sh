#!/usr/bin/env bash
# Runs a command with N busy loops beside it, as on a machine that other
# work keeps busy, and stops them however the command ends; exits with
# the command's status.
#
#   scripts/with-cpu-hogs.sh N -- command [args...]
#   scripts/with-cpu-hogs.sh 2 -- cargo test -p tidegate-loadtest --test scheduling
#
# N = 0 runs the command alone. Each loop also ends by itself once this
# script is gone (killed with -9, say), so none outlives it. The command
# runs as a background job of this script, so its stdin is /dev/null.
set -euo pipefail

usage() {
  echo "usage: $0 N -- command [args...]   (N busy loops beside the command)" >&2
  exit 2
}

[[ $# -ge 2 ]] || usage
hogs=$1
shift
[[ $hogs =~ ^[0-9]+$ ]] || usage
[[ $1 == -- ]] && shift
[[ $# -ge 1 ]] || usage

pids=()
cmd=
stop_hogs() {
  local p
  for p in "${pids[@]}"; do
    kill "$p" 2>/dev/null || true
  done
  for p in "${pids[@]}"; do
    wait "$p" 2>/dev/null || true
  done
  pids=()
}
# A signal ends the command too (SIGTERM: as a background job of this
# script it ignores SIGINT), then the hogs.
stop_all() {
  [[ -n $cmd ]] && kill -TERM "$cmd" 2>/dev/null
  exit "$1"
}
trap stop_hogs EXIT
trap 'stop_all 130' INT
trap 'stop_all 143' TERM

me=$$
for ((i = 0; i < hogs; i++)); do
  # A busy loop that looks up, every few hundred thousand turns, whether
  # this script still runs.
  (
    while kill -0 "$me" 2>/dev/null; do
      for ((j = 0; j < 300000; j++)); do :; done
    done
  ) &
  pids+=("$!")
done
if ((hogs > 0)); then
  echo "with-cpu-hogs: $hogs busy loop(s) beside: $*" >&2
fi

# In the background, so that a signal is handled now, not when it ends.
"$@" &
cmd=$!
status=0
wait "$cmd" || status=$?
cmd=
exit "$status"
