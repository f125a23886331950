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
pinned_venv peers "$here/requirements.txt"
