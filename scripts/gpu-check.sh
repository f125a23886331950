#!/usr/bin/env bash
# Every CUDA check of the worker, in one go, on a machine with an NVIDIA GPU
# (budget: under 8 minutes, most of it the release build). Prints the numbers
# that go into docs/benchmarks.md ("Worker: efficiency and start-up").
#
#   scripts/gpu-check.sh
#
# Needs: the NVIDIA driver (libcuda), NVRTC, CUDA runtime + cuDNN 9 for ONNX
# Runtime's CUDA provider, and ONNX Runtime's GPU build:
#   TIDEGATE_ORT_GPU_LIB=/path/libonnxruntime.so   (its providers next to it)
# else it is extracted from the pinned onnxruntime-gpu wheel (PyPI, sha256
# checked) into the tidegate cache. The models must be fetched (make setup).
#
# Steps: 1. what the machine has; 2. release build with --features cuda;
# 3. GPU tests with TIDEGATE_REQUIRE_GPU=1 (a skip is a failure here):
#    kernel == CPU preprocessing, CUDA detections == CPU within tolerance;
# 4. benchmarks: worker vs raw ONNX Runtime per batch size, on CPU and CUDA;
# 5. start-up: process start -> models warmed and profiled (check-config).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
# shellcheck source=scripts/cache.sh
source "$here/cache.sh"
cd "$root"
say() { printf '\n\033[1mgpu-check:\033[0m %s\n' "$*"; }
die() { printf 'gpu-check: error: %s\n' "$*" >&2; exit 1; }
started=$(date +%s)

say "1. machine"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv \
  || die "nvidia-smi not found: no NVIDIA driver here"
# onnxruntime-gpu 1.31.1 is built for CUDA 13 and cuDNN 9 (its wheel's
# [cuda,cudnn] extras: nvidia-cuda-runtime~=13.0, nvidia-cudnn-cu13~=9.0, ...);
# NVRTC of any recent version serves the preprocessing kernel.
# TIDEGATE_CUDA_LIBS: extra folders (colon-separated) holding those libraries.
if [ -n "${TIDEGATE_CUDA_LIBS:-}" ]; then
  export LD_LIBRARY_PATH="$TIDEGATE_CUDA_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
have_lib() {
  ldconfig -p | grep -q "$1" && return 0
  local d path="${LD_LIBRARY_PATH:-}"
  for d in ${path//:/ }; do compgen -G "$d/$1*" >/dev/null && return 0; done
  return 1
}
missing=()
for lib in libcuda.so.1 libnvrtc.so libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcufft.so.12 libcurand.so.10 libcudnn.so.9; do
  if have_lib "$lib"; then echo "  found $lib"; else echo "  MISSING $lib"; missing+=("$lib"); fi
done
if ((${#missing[@]})); then
  die "missing ${missing[*]}: install CUDA 13 + cuDNN 9 (e.g. pip install 'onnxruntime-gpu[cuda,cudnn]==1.31.1' into a venv) and point TIDEGATE_CUDA_LIBS at the folders holding them"
fi
[ -f models/blazeface/model.onnx ] || die "models/blazeface/model.onnx is missing; run make setup first"

if [ -z "${TIDEGATE_ORT_GPU_LIB:-}" ]; then
  ver=1.31.1
  wheel="onnxruntime_gpu-$ver-cp311-cp311-manylinux_2_28_x86_64.whl"
  wheel_sha=e26c475fe361b2015f45b4b824bd13f0bb20204e59b62814e6f0acd5f3d491a6
  dir="$TIDEGATE_CACHE/onnxruntime-gpu/$ver"
  if [ ! -f "$dir/libonnxruntime.so" ]; then
    mkdir -p "$TIDEGATE_CACHE/downloads" "$dir"
    if [ ! -f "$TIDEGATE_CACHE/downloads/$wheel" ]; then
      python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
        --platform manylinux_2_28_x86_64 -d "$TIDEGATE_CACHE/downloads" "onnxruntime-gpu==$ver" \
        || die "cannot download onnxruntime-gpu==$ver; set TIDEGATE_ORT_GPU_LIB instead"
    fi
    verify_sha256 "$TIDEGATE_CACHE/downloads/$wheel" "$wheel_sha" || die "onnxruntime-gpu checksum mismatch"
    unzip -q -o -j "$TIDEGATE_CACHE/downloads/$wheel" 'onnxruntime/capi/*.so*' -d "$dir"
    ln -sf "libonnxruntime.so.$ver" "$dir/libonnxruntime.so"
  fi
  TIDEGATE_ORT_GPU_LIB="$dir/libonnxruntime.so"
fi
export TIDEGATE_ORT_GPU_LIB
echo "  ONNX Runtime GPU build: $TIDEGATE_ORT_GPU_LIB"

say "2. release build (--features cuda)"
cargo build --release -p tidegate-worker --features cuda --bins --examples --tests 2>&1 | tail -2

say "3. GPU tests (a skip fails here)"
TIDEGATE_REQUIRE_GPU=1 cargo test --release -p tidegate-worker --features cuda --test gpu -- --nocapture --test-threads 1
cargo test --release -p tidegate-worker --features cuda --lib gpu -- --nocapture

say "4. benchmarks: worker vs raw ONNX Runtime (frames/s, best of 2 rounds of 1 s)"
echo "CPU, 1 intra-op thread:"
ORT_DYLIB_PATH="$TIDEGATE_ORT_GPU_LIB" cargo run --release -q -p tidegate-worker --features cuda --example bench -- \
  --threads 1 --seconds 1 --rounds 2
echo "CUDA:"
ORT_DYLIB_PATH="$TIDEGATE_ORT_GPU_LIB" cargo run --release -q -p tidegate-worker --features cuda --example bench -- \
  --cuda --seconds 1 --rounds 2

say "5. start-up: process start -> models loaded, warmed and profiled (check-config)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for provider in cpu cuda; do
  cat > "$tmp/w-$provider.toml" <<TOML
name = "gpu-check"
token = "unused"
[gateway]
addr = "127.0.0.1:9"
ca = "ca.pem"
[models]
dir = "$root/models"
only = ["blazeface"]
[runtime]
library = "$TIDEGATE_ORT_GPU_LIB"
provider = "$provider"
TOML
  t0=$(date +%s%N)
  "${CARGO_TARGET_DIR:-target}/release/tidegate-worker" --config "$tmp/w-$provider.toml" --log warn check-config
  t1=$(date +%s%N)
  echo "  $provider: $(( (t1 - t0) / 1000000 )) ms from exec to warmed and profiled"
done

say "done in $(( $(date +%s) - started )) s"
