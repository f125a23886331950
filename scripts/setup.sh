#!/usr/bin/env bash
# One-time (and idempotent) setup for a fresh Debian 12 (bookworm) machine.
# Installs only what is missing:
#   1. Debian packages: a C toolchain, GStreamer 1.22 (dev headers, plugins,
#      tools), pkg-config, Slurm and munge, and the python3/pip and npm
#      clients the fetch steps use.
#   2. The ONNX Runtime shared library, extracted from a pinned PyPI wheel
#      (sha256 checked) into the tidegate cache, where tidegate-worker finds it.
#   3. promtool and prometheus, from the pinned Debian prometheus package
#      (sha256 checked), unpacked into the cache.
#   4. NVRTC (the CUDA runtime compiler, no GPU needed), from NVIDIA's pinned
#      PyPI wheel (sha256 checked), for the GPU kernel's compile check.
#   5. The models and test imagery (models/fetch.sh and scripts/test-video.sh,
#      pinned and checksummed).
#   5b. The peers of make bench-peers (Triton through PyTriton, FastAPI,
#      onnxruntime): a venv of pinned, checksummed wheels (loadtest/peers/).
#   6. With --cuda (make test, make images-cuda): ONNX Runtime's GPU build and
#      the CUDA 13 libraries, for the CUDA worker image (scripts/cuda-libs.sh:
#      pinned wheels, 1.3 GB to fetch; no GPU needed).
# Re-running it is cheap: every step checks before it acts.
set -euo pipefail

cuda=0
for arg in "$@"; do
  case "$arg" in
    --cuda) cuda=1 ;;
    *) printf 'setup: error: unknown argument %s (usage: scripts/setup.sh [--cuda])\n' "$arg" >&2; exit 2 ;;
  esac
done

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
# shellcheck source=scripts/cache.sh
source "$here/cache.sh"

say() { printf '\033[1msetup:\033[0m %s\n' "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

# --- 1. Debian packages -----------------------------------------------------
apt_packages=(
  build-essential pkg-config  # a C compiler and linker: ring and the bundled SQLite are C
  libgstreamer1.0-dev libgstreamer-plugins-base1.0-dev
  gstreamer1.0-plugins-base gstreamer1.0-plugins-good gstreamer1.0-plugins-bad
  gstreamer1.0-plugins-ugly gstreamer1.0-libav gstreamer1.0-tools
  libgstrtspserver-1.0-dev
  python3 python3-pip npm unzip ca-certificates
  python3-venv  # models/fetch.sh: the pinned onnx tools (BlazeFace batch rewrite, emotion and CenterNet conversion)
  slurmctld slurmd slurm-client munge  # the slurm lease provider's tests run a private one-node cluster
  mosquitto  # the edge's MQTT sink tests run a private broker on 127.0.0.1
  chromium  # loadtest/tests/status_page.rs renders the gateway's status page headless
)
missing=()
for p in "${apt_packages[@]}"; do
  # A tool that is already on PATH (python3, pip, npm installed another way) counts.
  case "$p" in
    python3) command -v python3 >/dev/null && continue ;;
    python3-pip) python3 -m pip --version >/dev/null 2>&1 && continue ;;
    npm) command -v npm >/dev/null && continue ;;
    unzip) command -v unzip >/dev/null && continue ;;
  esac
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  say "installing Debian packages: ${missing[*]}"
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq || die "apt-get update failed; check your network or apt sources, then re-run 'make setup'"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" \
    || die "apt-get install of ${missing[*]} failed; re-run 'make setup' (it resumes where it stopped)"
else
  say "Debian packages: all present"
fi

# --- 2. ONNX Runtime shared library -----------------------------------------
ORT_VERSION=1.31.1
ORT_WHEEL="onnxruntime-${ORT_VERSION}-cp311-cp311-manylinux_2_28_x86_64.whl"
ORT_WHEEL_SHA256=5752bd508126ae7c49894d3b9d2e83f0c3d487319246d04c444b393308d7ad7f
ort_dir="$TIDEGATE_CACHE/onnxruntime/$ORT_VERSION"
if [ "$(uname -m)" != "x86_64" ]; then
  die "the pinned ONNX Runtime wheel is for x86_64; on $(uname -m) set ORT_DYLIB_PATH to your own libonnxruntime.so"
fi
# Its licence and third-party notices go beside it: they ship with it in the
# worker's container image (scripts/image.py).
if [ -f "$ort_dir/libonnxruntime.so" ] && [ -f "$ort_dir/LICENSE" ] \
  && [ -f "$ort_dir/ThirdPartyNotices.txt" ]; then
  say "ONNX Runtime $ORT_VERSION: present in $ort_dir"
else
  dl="$TIDEGATE_CACHE/downloads"
  mkdir -p "$ort_dir"
  fetch_wheel "onnxruntime==$ORT_VERSION" "$ORT_WHEEL" "$ORT_WHEEL_SHA256" \
    || die "could not fetch onnxruntime==$ORT_VERSION (see above)"
  tmp="$(mktemp -d)"
  unzip -q -o -j "$dl/$ORT_WHEEL" "onnxruntime/capi/libonnxruntime.so.$ORT_VERSION" \
    "onnxruntime/capi/libonnxruntime_providers_shared.so" \
    "onnxruntime/LICENSE" "onnxruntime/ThirdPartyNotices.txt" -d "$tmp"
  mv "$tmp/libonnxruntime.so.$ORT_VERSION" "$ort_dir/"
  mv "$tmp/libonnxruntime_providers_shared.so" "$ort_dir/"
  mv "$tmp/LICENSE" "$tmp/ThirdPartyNotices.txt" "$ort_dir/"
  ln -sf "libonnxruntime.so.$ORT_VERSION" "$ort_dir/libonnxruntime.so"
  rmdir "$tmp"
  say "ONNX Runtime $ORT_VERSION: installed in $ort_dir"
fi

# --- 3. promtool and prometheus ----------------------------------------------
# deploy/tests/deploy.rs checks deploy/'s alert rules and dashboard with
# Prometheus's own promtool, and loadtest/tests/prometheus_live.rs runs a
# real Prometheus server (on 127.0.0.1, started by the test) against a
# gateway. Both come from Debian's `prometheus` package, pinned by version
# and sha256 (fetch_deb, scripts/cache.sh), and are unpacked into the cache,
# not installed, so no Prometheus service starts here.
PROMETHEUS_DEB_VERSION=2.42.0+ds-5+deb12u1
PROMETHEUS_DEB_SHA256=81d59a24fce84f7fbe97a45a4f2914b6a5881b5cd1db2a6a0e129e515e1a5f55
PROMTOOL_SHA256=14d9c8acdc5d1321dc2092400111c586f09ac350f23f2383d1679b2bf256e583
PROMETHEUS_SHA256=814f078f68af9ad7b644fd25299211399c8f19ad9adf8b0a1b86a3bd9755baa0
promtool_dir="$TIDEGATE_CACHE/promtool"
if [ -x "$promtool_dir/promtool" ] && [ -x "$promtool_dir/prometheus" ] \
  && [ "$(sha256sum "$promtool_dir/promtool" | cut -d' ' -f1)" = "$PROMTOOL_SHA256" ] \
  && [ "$(sha256sum "$promtool_dir/prometheus" | cut -d' ' -f1)" = "$PROMETHEUS_SHA256" ]; then
  say "promtool and prometheus: present in $promtool_dir"
else
  deb="$(fetch_deb prometheus "$PROMETHEUS_DEB_VERSION" "$PROMETHEUS_DEB_SHA256")" \
    || die "could not fetch prometheus=$PROMETHEUS_DEB_VERSION for promtool (see above)"
  tmp="$(mktemp -d)"
  dpkg-deb -x "$deb" "$tmp"
  mkdir -p "$promtool_dir"
  verify_sha256 "$tmp/usr/bin/promtool" "$PROMTOOL_SHA256" || die "promtool checksum mismatch"
  verify_sha256 "$tmp/usr/bin/prometheus" "$PROMETHEUS_SHA256" || die "prometheus checksum mismatch"
  mv "$tmp/usr/bin/promtool" "$tmp/usr/bin/prometheus" "$promtool_dir/"
  rm -rf "$tmp"
  say "promtool and prometheus: $("$promtool_dir/prometheus" --version 2>&1 | head -1) in $promtool_dir"
fi

# --- 4. NVRTC ----------------------------------------------------------------
# The worker's GPU preprocessing kernel is compiled by NVRTC at start. NVRTC
# needs no GPU and no driver, so cloud-worker/tests/gpu_kernel.rs compiles the
# kernel with it on any machine. It comes from NVIDIA's PyPI wheel, pinned by
# version and sha256; only the two libraries and NVIDIA's licence are kept, in
# the cache (the CUDA worker image ships all three).
NVRTC_VERSION=12.9.86
NVRTC_WHEEL="nvidia_cuda_nvrtc_cu12-${NVRTC_VERSION}-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl"
NVRTC_WHEEL_SHA256=210cf05005a447e29214e9ce50851e83fc5f4358df8b453155d5e1918094dcb4
NVRTC_LIB_SHA256=7c67c6b51ea0e0279634cebd676ff7efda1674806444520c84430ad5c35fe625
NVRTC_BUILTINS="libnvrtc-builtins.so.${NVRTC_VERSION%.*}"
NVRTC_BUILTINS_SHA256=6507cf33450cfb22970c2c1e7aa8e7c0a33e39d864720277b05f61a92791e2e8
nvrtc_dir="$TIDEGATE_CACHE/cuda-nvrtc/$NVRTC_VERSION"
if [ -f "$nvrtc_dir/libnvrtc.so.12" ] && [ -f "$nvrtc_dir/$NVRTC_BUILTINS" ] \
  && [ -f "$nvrtc_dir/License.txt" ] && [ "$(sha256sum "$nvrtc_dir/libnvrtc.so.12" | cut -d' ' -f1)" = "$NVRTC_LIB_SHA256" ]; then
  say "NVRTC $NVRTC_VERSION: present in $nvrtc_dir"
else
  dl="$TIDEGATE_CACHE/downloads"
  mkdir -p "$nvrtc_dir"
  fetch_wheel "nvidia-cuda-nvrtc-cu12==$NVRTC_VERSION" "$NVRTC_WHEEL" "$NVRTC_WHEEL_SHA256" \
    manylinux_2_12_x86_64 || die "could not fetch nvidia-cuda-nvrtc-cu12==$NVRTC_VERSION (90 MB, see above)"
  tmp="$(mktemp -d)"
  unzip -q -o -j "$dl/$NVRTC_WHEEL" "nvidia/cuda_nvrtc/lib/libnvrtc.so.12" \
    "nvidia/cuda_nvrtc/lib/$NVRTC_BUILTINS" '*.dist-info/licenses/License.txt' -d "$tmp"
  verify_sha256 "$tmp/libnvrtc.so.12" "$NVRTC_LIB_SHA256" || die "libnvrtc checksum mismatch"
  verify_sha256 "$tmp/$NVRTC_BUILTINS" "$NVRTC_BUILTINS_SHA256" || die "NVRTC builtins checksum mismatch"
  mv "$tmp/$NVRTC_BUILTINS" "$nvrtc_dir/"
  mv "$tmp/libnvrtc.so.12" "$tmp/License.txt" "$nvrtc_dir/"
  rmdir "$tmp"
  say "NVRTC $NVRTC_VERSION: installed in $nvrtc_dir"
fi

# --- 5. Models and imagery --------------------------------------------------
"$root/models/fetch.sh"
bash "$root/scripts/test-video.sh"

# --- 5b. The peers of make bench-peers ---------------------------------------
# Triton (PyTriton), FastAPI + uvicorn and onnxruntime in a venv of the cache,
# every file pinned with its sha256; the peers' tests in make test use it.
bash "$root/loadtest/peers/setup.sh" >/dev/null \
  || die "the peers' venv (loadtest/peers/setup.sh) could not be created; see above"
say "peers' venv: present"

# --- 6. The CUDA worker image's libraries (--cuda) -----------------------------
if [ "$cuda" = 1 ]; then
  bash "$here/cuda-libs.sh" >/dev/null
fi

say "done. Try 'make demo' or 'make test'."
