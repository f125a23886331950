#!/usr/bin/env bash
# The peers' Python: a venv in tidegate's cache holding exactly the files of
# loadtest/peers/requirements.txt (NVIDIA PyTriton, FastAPI + uvicorn,
# onnxruntime and numpy, each pinned with its sha256; pip --require-hashes).
# Created once per requirements file; prints the venv's python on its last
# line. Used by scripts/bench-peers.py and the peers' tests.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../../scripts/cache.sh
source "$here/../../scripts/cache.sh"
req="$here/requirements.txt"
venv="$TIDEGATE_CACHE/venv/peers-$(sha256sum "$req" | cut -c1-12)"
if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
  printf 'peers: creating %s (pytriton, fastapi, onnxruntime; pinned with sha256)\n' "$venv" >&2
  rm -rf "$venv"
  python3 -m venv "$venv" || {
    echo "peers: python3 -m venv failed; install python3-venv (make setup does) and re-run" >&2
    exit 1
  }
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    --require-hashes --only-binary=:all: -r "$req" >&2 || {
    echo "peers: pip install -r $req failed; check access to PyPI and re-run" >&2
    exit 1
  }
  touch "$venv/.complete"
fi
printf '%s\n' "$venv/bin/python"
