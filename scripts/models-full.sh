#!/usr/bin/env bash
# Opt-in models and imagery for heavier (GPU) runs: `make models-full`.
# Everything is fetched by name and version from package registries and
# checked against a pinned sha256; re-running is cheap.
#   CenterNet (MB3-CenterNet, COCO, 512x512): the TF.js graph model in npm
#     @vladmandic/human@3.3.6 (MIT; pinned in scripts/cache.sh), converted to
#     ONNX by models/centernet/convert.py with pinned tensorflow-cpu 2.15.1 +
#     tf2onnx 1.16.1 in a venv in the cache (models/centernet/requirements.txt,
#     --require-hashes).
#   vtest.avi (pedestrians, 768x576): Debian opencv-doc 4.6.0+dfsg-12 (95 MB .deb,
#     only this file is kept), plus four frames as PNG for the tests (GStreamer).
# Needs: python3 (3.11) with venv, npm, apt-get, dpkg-deb, gst-launch-1.0.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
# shellcheck source=scripts/cache.sh
source "$here/cache.sh"
say() { printf '\033[1mmodels-full:\033[0m %s\n' "$*"; }
die() { printf 'models-full: error: %s\n' "$*" >&2; exit 1; }
has_sha() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]; }
dl="$TIDEGATE_CACHE/downloads"
mkdir -p "$dl"
models="$root/models"

# The BlazeFace model and astronaut.png come first (the CenterNet test uses it).
"$models/fetch.sh"

# CenterNet --------------------------------------------------------------------
cn_dir="$models/centernet"
cn_onnx="$cn_dir/model.onnx"
if [ -f "$cn_onnx" ]; then
  say "centernet: present ($cn_onnx)"
else
  # The tarball (pinned in scripts/cache.sh) is normally there already:
  # fetch.sh takes the emotion model from it.
  fetch_npm "$HUMAN_NPM" "$HUMAN_TGZ" "$HUMAN_SHA256" \
    || die "fetching $HUMAN_NPM failed (see above)"
  req="$cn_dir/requirements.txt"
  venv="$TIDEGATE_CACHE/venv/tfjs-convert-$(sha256sum "$req" | cut -c1-12)"
  if [ ! -f "$venv/.complete" ]; then
    say "creating $venv (tensorflow-cpu 2.15.1, tf2onnx 1.16.1; pinned with sha256; ~300 MB)"
    rm -rf "$venv"
    python3 -m venv "$venv" || die "python3 -m venv failed; install python3-venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
      --require-hashes --only-binary=:all: -r "$req" \
      || die "pip install -r $req failed (these wheels are for CPython 3.11 on x86_64 Linux)"
    touch "$venv/.complete"
  fi
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  tar -xzf "$dl/$HUMAN_TGZ" -C "$tmp" package/models/centernet.json package/models/centernet.bin package/LICENSE
  say "centernet: converting TF.js -> ONNX"
  "$venv/bin/python" "$cn_dir/convert.py" "$tmp/package/models" "$cn_onnx" \
    || die "centernet conversion failed (see above)"
  cp "$tmp/package/LICENSE" "$cn_dir/LICENSE.model"
  say "centernet: installed $cn_onnx"
fi

# vtest.avi and test frames --------------------------------------------------------
vt_dir="$models/testdata/vtest"
vtest="$vt_dir/vtest.avi"
vtest_sha=45cddc9490be69345cbdab64ca583be65987e864ca408038e648db99e10516cf
deb="opencv-doc_4.6.0+dfsg-12_all.deb"
deb_sha=4b12681df35878207ac7097dc66184b2ae552e4bf4ddd2af04a0f03ed0b8682a
mkdir -p "$vt_dir"
if has_sha "$vtest" "$vtest_sha"; then
  say "vtest.avi: present"
else
  if ! has_sha "$dl/$deb" "$deb_sha"; then
    say "downloading Debian opencv-doc 4.6.0+dfsg-12 (95 MB) for vtest.avi"
    (cd "$dl" && apt-get download "opencv-doc=4.6.0+dfsg-12") \
      || die "apt-get download opencv-doc=4.6.0+dfsg-12 failed; run 'apt-get update' or check your apt sources"
    verify_sha256 "$dl/$deb" "$deb_sha" || die "opencv-doc checksum mismatch"
  fi
  dpkg-deb --fsys-tarfile "$dl/$deb" \
    | tar -xO ./usr/share/doc/opencv-doc/examples/data/vtest.avi > "$vtest.tmp"
  verify_sha256 "$vtest.tmp" "$vtest_sha" || die "vtest.avi checksum mismatch"
  mv "$vtest.tmp" "$vtest"
  say "vtest.avi: installed $vtest"
fi
if [ ! -f "$vt_dir/frame-60.png" ]; then
  # One frame a second; keep seconds 0, 20, 40 and 60.
  ftmp="$(mktemp -d)"
  gst-launch-1.0 -q filesrc location="$vtest" ! decodebin ! videorate ! video/x-raw,framerate=1/1 \
    ! videoconvert ! video/x-raw,format=RGB ! pngenc ! multifilesink location="$ftmp/f-%02d.png" \
    || die "decoding vtest.avi with GStreamer failed (make setup installs it)"
  for s in 00 20 40 60; do cp "$ftmp/f-$s.png" "$vt_dir/frame-$s.png"; done
  rm -rf "$ftmp"
  say "vtest.avi: frames 0, 20, 40, 60 s in $vt_dir"
fi
say "done. Run: cargo test -p tidegate-worker --test centernet"
