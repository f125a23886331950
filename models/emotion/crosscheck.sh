#!/usr/bin/env bash
# Development check of models/emotion/model.onnx against TensorFlow and
# tf2onnx (models/emotion/crosscheck.py). Needs `make setup` (the model, the
# human tarball and the onnx tools venv) and `make models-full` (the venv
# with tensorflow-cpu and tf2onnx). Not run by make setup or make test.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
# shellcheck source=../../scripts/cache.sh
source "$root/scripts/cache.sh"
die() { printf 'crosscheck: error: %s\n' "$*" >&2; exit 1; }
venv() { printf '%s/venv/%s-%s\n' "$TIDEGATE_CACHE" "$1" "$(sha256sum "$2" | cut -c1-12)"; }
tools="$(venv model-tools "$root/models/tools/requirements.txt")"
tf="$(venv tfjs-convert "$root/models/centernet/requirements.txt")"
[ -f "$tools/.complete" ] && [ -f "$here/model.onnx" ] || die "run 'make setup' first"
[ -f "$tf/.complete" ] || die "no TensorFlow venv at $tf; run 'make models-full' first"
tgz="$TIDEGATE_CACHE/downloads/$HUMAN_TGZ"
verify_sha256 "$tgz" "$HUMAN_SHA256" || die "run 'make setup' to fetch $HUMAN_NPM again"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
tar -xzf "$tgz" -C "$tmp" package/models/emotion.json package/models/emotion.bin
"$tools/bin/python" "$here/crosscheck.py" "$tf/bin/python" "$tmp/package/models" \
  "$root/models/testdata/astronaut.png" "$here/model.onnx"
