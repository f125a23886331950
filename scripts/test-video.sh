#!/usr/bin/env bash
# Test video for CenterNet's pedestrian test, fetched by `make setup` (after
# the models, models/fetch.sh). Fetched by name and version from a package
# registry and checked against a pinned sha256; re-running is cheap.
#   vtest.avi (pedestrians, 768x576): Debian opencv-doc 4.6.0+dfsg-12 (95 MB .deb,
#     only this file is kept), plus four frames as PNG for the tests (GStreamer);
#     cloud-worker/tests/centernet.rs runs on them.
# Needs: apt-get, dpkg-deb, gst-launch-1.0 (make setup installs GStreamer).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
# shellcheck source=scripts/cache.sh
source "$here/cache.sh"
say() { printf '\033[1mtest-video:\033[0m %s\n' "$*"; }
die() { printf 'test-video: error: %s\n' "$*" >&2; exit 1; }
has_sha() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]; }
dl="$TIDEGATE_CACHE/downloads"
mkdir -p "$dl"
models="$root/models"

# vtest.avi and test frames --------------------------------------------------------
vt_dir="$models/testdata/vtest"
vtest="$vt_dir/vtest.avi"
vtest_sha=45cddc9490be69345cbdab64ca583be65987e864ca408038e648db99e10516cf
deb_version=4.6.0+dfsg-12
deb_sha=4b12681df35878207ac7097dc66184b2ae552e4bf4ddd2af04a0f03ed0b8682a
mkdir -p "$vt_dir"
if has_sha "$vtest" "$vtest_sha"; then
  say "vtest.avi: present"
else
  say "Debian opencv-doc $deb_version (95 MB) for vtest.avi"
  deb="$(fetch_deb opencv-doc "$deb_version" "$deb_sha")" \
    || die "could not fetch opencv-doc=$deb_version (see above)"
  dpkg-deb --fsys-tarfile "$deb" \
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
say "vtest: done"
