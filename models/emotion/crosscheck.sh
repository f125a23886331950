#!/usr/bin/env bash
# Development check of models/emotion/model.onnx against TensorFlow and
# tf2onnx (models/emotion/crosscheck.py). Needs `make setup` (the model, the
# human tarball and the onnx tools venv); creates the reference venv with
# tensorflow-cpu and tf2onnx on first use (models/tools/reference.sh).
# Not run by make setup or make test.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
# shellcheck source=../../scripts/cache.sh
source "$root/scripts/cache.sh"
# shellcheck source=../tools/reference.sh
source "$root/models/tools/reference.sh"
die() { printf 'crosscheck: error: %s\n' "$*" >&2; exit 1; }
tools="$TIDEGATE_CACHE/venv/model-tools-$(sha256sum "$root/models/tools/requirements.txt" | cut -c1-12)"
[ -f "$tools/.complete" ] && [ -f "$here/model.onnx" ] || die "run 'make setup' first"
tf="$(reference_python)" || die "could not create the reference venv (see above)"
tgz="$TIDEGATE_CACHE/downloads/$HUMAN_TGZ"
verify_sha256 "$tgz" "$HUMAN_SHA256" || die "run 'make setup' to fetch $HUMAN_NPM again"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
tar -xzf "$tgz" -C "$tmp" package/models/emotion.json package/models/emotion.bin
"$tools/bin/python" "$here/crosscheck.py" "$tf" "$tmp/package/models" \
  "$root/models/testdata/astronaut.png" "$here/model.onnx"
