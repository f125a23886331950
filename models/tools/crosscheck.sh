#!/usr/bin/env bash
# Development check of a converted TF.js model against TensorFlow and tf2onnx:
#   models/tools/crosscheck.sh NAME [INPUT ...]
# runs models/NAME/crosscheck.py TF_PYTHON TFJS_DIR INPUT ... models/NAME/model.onnx
# in the onnx tools venv, with TFJS_DIR holding NAME.json/.bin from the pinned
# human tarball. Needs `make setup` (the model, the tarball and the tools
# venv); creates the reference venv (tensorflow-cpu, tf2onnx) on first use
# (models/tools/reference.sh). Not run by make setup or make test.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=../../scripts/cache.sh
source "$root/scripts/cache.sh"
# shellcheck source=reference.sh
source "$root/models/tools/reference.sh"
die() { printf 'crosscheck: error: %s\n' "$*" >&2; exit 1; }
name="${1:?usage: crosscheck.sh NAME [INPUT ...]}"
shift
model="$root/models/$name"
tools="$TIDEGATE_CACHE/venv/model-tools-$(sha256sum "$root/models/tools/requirements.txt" | cut -c1-12)"
[ -f "$tools/.complete" ] && [ -f "$model/model.onnx" ] || die "run 'make setup' first"
tf="$(reference_python)" || die "could not create the reference venv (see above)"
tgz="$TIDEGATE_CACHE/downloads/$HUMAN_TGZ"
verify_sha256 "$tgz" "$HUMAN_SHA256" || die "run 'make setup' to fetch $HUMAN_NPM again"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
tar -xzf "$tgz" -C "$tmp" "package/models/$name.json" "package/models/$name.bin"
"$tools/bin/python" "$model/crosscheck.py" "$tf" "$tmp/package/models" "$@" "$model/model.onnx"
