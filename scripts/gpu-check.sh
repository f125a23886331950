#!/usr/bin/env bash
# Every CUDA check of the worker, in one go, on a machine with an NVIDIA GPU.
# Prints the numbers that go into docs/benchmarks.md.
#
#   scripts/gpu-check.sh                 build a kit here (cargo, PyPI), run it
#   scripts/gpu-check.sh --kit DIR       run a kit built by scripts/gpu-kit.sh
#                                        (no Rust toolchain, no network needed)
#   scripts/gpu-check.sh --kit DIR --rehearse
#                                        the same without a GPU: checks the kit
#                                        and runs the CPU half (tests skip)
#
# Needs on the GPU machine: the NVIDIA driver (libcuda), NVRTC, and CUDA 13 +
# cuDNN 9 for ONNX Runtime's CUDA provider. They are looked for in
# /usr/local/cuda, in the nvidia-* Python packages of python3 (a PyTorch or
# onnxruntime-gpu install has them), and in TIDEGATE_CUDA_LIBS (extra
# folders, colon-separated).
#
# Steps: 1. what the machine has; 2. GPU tests with TIDEGATE_REQUIRE_GPU=1
# (a skip is a failure): kernel == CPU preprocessing, CUDA detections == CPU
# within tolerance; 3. benchmarks: worker vs raw ONNX Runtime per batch size
# on CPU and CUDA, and u8 upload + GPU normalise vs f32 upload, for BlazeFace
# and (when in the kit) CenterNet; 4. start-up: process start -> models
# warmed and profiled (check-config), CPU and CUDA.
# Output also goes to $OUT/gpu-check.log when OUT is set, else KIT/gpu-check.log.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
cd "$root"
say() { printf '\n\033[1mgpu-check:\033[0m %s\n' "$*"; }
die() { printf 'gpu-check: error: %s\n' "$*" >&2; exit 1; }
started=$(date +%s)

kit="" rehearse=0
while [ $# -gt 0 ]; do
  case "$1" in
    --kit) kit="${2:?--kit needs a folder}"; shift 2 ;;
    --rehearse) rehearse=1; shift ;;
    *) die "unknown argument $1; see the header of scripts/gpu-check.sh" ;;
  esac
done
if [ -z "$kit" ]; then
  command -v nvidia-smi >/dev/null || die "nvidia-smi not found: no NVIDIA driver here"
  kit="$root/target/gpukit"
  bash "$here/gpu-kit.sh" "$kit"
fi
kit="$(cd "$kit" && pwd)"
log="${OUT:-$kit}/gpu-check.log"
exec > >(tee "$log") 2>&1

say "1. machine and kit"
(cd "$kit" && sha256sum --quiet -c manifest.txt) || die "the kit in $kit is incomplete or damaged (manifest.txt); bring every ort-N part, bin/ and models/"
if ((rehearse)); then
  echo "  rehearsal: no GPU needed; the GPU tests may skip"
else
  command -v nvidia-smi >/dev/null || die "nvidia-smi not found: no NVIDIA driver here"
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv
fi
ort="$kit/ort"
if [ ! -f "$ort/libonnxruntime.so" ]; then
  mkdir -p "$ort"
  cat "$kit"/ort-*/ort.tar.xz.* | xz -d | tar -C "$ort" -xf -
  ln -sf libonnxruntime.so.1.31.1 "$ort/libonnxruntime.so"
fi
export TIDEGATE_ORT_GPU_LIB="$ort/libonnxruntime.so" ORT_DYLIB_PATH="$ort/libonnxruntime.so"
export TIDEGATE_MODELS_DIR="$kit/models"
echo "  ONNX Runtime GPU build: $TIDEGATE_ORT_GPU_LIB"

# CUDA libraries: the toolkit, python3's nvidia-* packages, TIDEGATE_CUDA_LIBS.
dirs=()
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && dirs+=("$d")
done
if command -v python3 >/dev/null; then
  while IFS= read -r d; do dirs+=("$d"); done < <(python3 - <<'PY' 2>/dev/null || true
import glob, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()] + sys.path
seen = set()
for r in roots:
    for d in sorted(glob.glob(f"{r}/nvidia/*/lib") + glob.glob(f"{r}/nvidia/cu*/lib")):
        if d not in seen:
            seen.add(d)
            print(d)
PY
  )
fi
IFS=: read -r -a extra <<<"${TIDEGATE_CUDA_LIBS:-}"
dirs+=("${extra[@]}")
# cudarc (built for CUDA 12) asks for libnvrtc.so / .so.12; CUDA 13 names it
# .so.13, so give it the plain name.
mkdir -p "$kit/lib"
for d in "${dirs[@]}"; do
  for f in "$d"/libnvrtc.so.1[0-9]*; do
    [ -e "$f" ] && [ ! -e "$kit/lib/libnvrtc.so" ] && ln -s "$f" "$kit/lib/libnvrtc.so"
  done
done
path="$kit/lib"
for d in "${dirs[@]}"; do path="$path:$d"; done
export LD_LIBRARY_PATH="$path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "  library path: $LD_LIBRARY_PATH"
if ((!rehearse)); then
  missing="$(ldd "$ort/libonnxruntime_providers_cuda.so" | awk '/not found/ {print $1}' | tr '\n' ' ')"
  [ -z "$missing" ] || die "the CUDA provider needs $missing: install CUDA 13 + cuDNN 9 (pip install 'onnxruntime-gpu[cuda,cudnn]==1.31.1') or point TIDEGATE_CUDA_LIBS at them"
  [ -e "$kit/lib/libnvrtc.so" ] || die "no libnvrtc.so.1x found in ${dirs[*]}"
fi

say "2. GPU tests (a skip fails here)"
if ((rehearse)); then
  "$kit/bin/gpu-test" --nocapture --test-threads 1
else
  TIDEGATE_REQUIRE_GPU=1 "$kit/bin/gpu-test" --nocapture --test-threads 1
fi
"$kit/bin/lib-test" gpu --nocapture

say "3. benchmarks: worker vs raw ONNX Runtime (frames/s, best of 2 rounds of 1 s)"
echo "blazeface, CPU, 1 intra-op thread:"
"$kit/bin/bench" --threads 1 --seconds 1 --rounds 2
if ((!rehearse)); then
  for m in blazeface centernet; do
    [ -f "$kit/models/$m/model.onnx" ] || continue
    echo "$m, CUDA (third column: u8 upload + GPU normalise against CPU normalise + f32 upload):"
    "$kit/bin/bench" --cuda --model "$m" --seconds 1 --rounds 2
  done
fi

say "4. start-up: process start -> models loaded, warmed and profiled (check-config)"
providers=(cpu)
((rehearse)) || providers+=(cuda)
for provider in "${providers[@]}"; do
  cat >"$kit/w-$provider.toml" <<TOML
name = "gpu-check"
token = "unused"
[gateway]
addr = "127.0.0.1:9"
ca = "ca.pem"
[models]
dir = "$kit/models"
only = ["blazeface"]
[runtime]
library = "$TIDEGATE_ORT_GPU_LIB"
provider = "$provider"
TOML
  t0=$(date +%s%N)
  "$kit/bin/tidegate-worker" --config "$kit/w-$provider.toml" --log warn check-config
  t1=$(date +%s%N)
  echo "  $provider: $(((t1 - t0) / 1000000)) ms from exec to warmed and profiled"
done

say "done in $(($(date +%s) - started)) s; log in $log"
