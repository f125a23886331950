#!/usr/bin/env bash
# Builds a GPU kit: everything scripts/gpu-check.sh needs to run the worker's
# CUDA tests and benchmarks on a GPU machine that has the NVIDIA driver and
# CUDA 13 libraries but no Rust toolchain and no network (a lent cloud GPU,
# say). Run it on a build machine with this checkout set up (make setup).
#
#   scripts/gpu-kit.sh [KIT_DIR]        (default: .gpukit, git-ignored)
#
# The kit is only folders part-1, part-2, ... of at most KIT_PART_MB
# (default 56) MiB each, so that no one transfer exceeds a size cap, and
# KIT/manifest.txt (every file's sha256, checked on the GPU machine). The
# parts hold, compressed (xz):
#   ort.tar.xz.NN  ONNX Runtime's GPU build (the pinned onnxruntime-gpu
#                  wheel's libonnxruntime + CUDA and TensorRT providers,
#                  300 MB unpacked), split across the first parts;
#   tools.tar.xz   (in the last part with room, else a part of its own):
#     bin/     release builds (--features cuda, stripped): tidegate-worker,
#              the bench example, the `gpu` test and the crate's unit tests
#     e2e/     release tidegate-gateway, tidegate-loadtest and tidegate-bench
#              (stripped), for the end-to-end steps (a local gateway and CUDA
#              workers) and the WAN case (the impairment relay)
#     models/  blazeface (and centernet, when fetched) + astronaut.png
# gpu-check.sh unpacks both on the GPU machine.
# Then, on the GPU machine, in a checkout with the kit beside it:
#   scripts/gpu-check.sh --kit KIT_DIR
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
# shellcheck source=scripts/cache.sh
source "$here/cache.sh"
cd "$root"
say() { printf '\033[1mgpu-kit:\033[0m %s\n' "$*"; }
die() { printf 'gpu-kit: error: %s\n' "$*" >&2; exit 1; }
kit="${1:-.gpukit}"
part_mb="${KIT_PART_MB:-56}"
target="${CARGO_TARGET_DIR:-$root/target}"

[ -f models/blazeface/model.onnx ] || die "models/blazeface/model.onnx is missing; run make setup first"
[ -f models/testdata/astronaut.png ] || die "models/testdata/astronaut.png is missing; run make setup first"

say "release build of the worker, its bench and its GPU tests (--features cuda)"
cargo build --release -p tidegate-worker --features cuda --bins --examples
cargo build --release -p tidegate-gateway -p tidegate-loadtest --bins
# The test executables' paths, from cargo's JSON messages.
tests="$(cargo test --release -p tidegate-worker --features cuda --lib --test gpu --no-run \
  --message-format=json | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["target"]["kind"][0], m["executable"])
')"
lib_test="$(awk '$1 == "lib" {print $2}' <<<"$tests")"
gpu_test="$(awk '$1 == "test" {print $2}' <<<"$tests")"
[ -x "$lib_test" ] && [ -x "$gpu_test" ] || die "could not find the test executables in: $tests"

rm -rf "$kit"
tools="$(mktemp -d)"
trap 'rm -rf "$tools"' EXIT
mkdir -p "$kit" "$tools/bin" "$tools/e2e" "$tools/models/testdata"
install -m 755 "$target/release/tidegate-worker" "$tools/bin/tidegate-worker"
install -m 755 "$target/release/examples/bench" "$tools/bin/bench"
install -m 755 "$gpu_test" "$tools/bin/gpu-test"
install -m 755 "$lib_test" "$tools/bin/lib-test"
install -m 755 "$target/release/tidegate-gateway" "$target/release/tidegate-loadtest" \
  "$target/release/tidegate-bench" "$tools/e2e/"
strip --strip-debug "$tools"/bin/* "$tools"/e2e/*
for m in blazeface centernet; do
  if [ -f "models/$m/model.onnx" ]; then
    mkdir -p "$tools/models/$m"
    cp "models/$m/model.toml" "models/$m/model.onnx" "$tools/models/$m/"
    # The FP16 variant (runtime.precision = "fp16"), where fetch.sh built one.
    [ ! -f "models/$m/model.fp16.onnx" ] || cp "models/$m/model.fp16.onnx" "$tools/models/$m/"
  fi
done
cp models/testdata/astronaut.png "$tools/models/testdata/"
say "compressing the binaries and models (xz)"
tar -C "$tools" -cf - bin e2e models | xz -T0 -6 >"$kit/tools.tar.xz"

say "ONNX Runtime's GPU build (pinned onnxruntime-gpu wheel)"
ver="$ORT_GPU_VERSION"
# With TensorRT's provider library since session 32 (a new name, so that an
# older packing without it is not reused).
packed="$TIDEGATE_CACHE/onnxruntime-gpu/$ver-tensorrt.tar.xz"
if [ ! -f "$packed" ]; then
  say "compressing the CUDA provider (xz, a few minutes, once)"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp" "$tools"' EXIT
  mkdir "$tmp/ort"
  # Unpacked by scripts/cuda-libs.sh (with the CUDA image's libraries) if it
  # ran, else from the wheel alone.
  unpacked="$TIDEGATE_CACHE/cuda-libs/onnxruntime-gpu-$ver"
  # TensorRT's provider (1 MB) comes from the wheel: scripts/cuda-libs.sh
  # unpacks only what the CUDA image needs. TensorRT 10 itself, which it
  # links, is not on PyPI as a wheel; the GPU host brings it
  # (docs/operations.md, "Half precision and TensorRT").
  fetch_wheel "onnxruntime-gpu==$ver" "$ORT_GPU_WHEEL" "$ORT_GPU_SHA256" \
    || die "cannot fetch onnxruntime-gpu==$ver (see above)"
  wheel="$TIDEGATE_CACHE/downloads/$ORT_GPU_WHEEL"
  if [ -f "$unpacked/complete" ]; then
    cp "$unpacked/onnxruntime/libonnxruntime.so.$ver" \
      "$unpacked"/onnxruntime/libonnxruntime_providers_{shared,cuda}.so "$tmp/ort/"
    unzip -q -o -j "$wheel" 'onnxruntime/capi/libonnxruntime_providers_tensorrt.so' -d "$tmp/ort"
  else
    unzip -q -o -j "$wheel" \
      "onnxruntime/capi/libonnxruntime.so.$ver" \
      'onnxruntime/capi/libonnxruntime_providers_shared.so' \
      'onnxruntime/capi/libonnxruntime_providers_cuda.so' \
      'onnxruntime/capi/libonnxruntime_providers_tensorrt.so' -d "$tmp/ort"
  fi
  # Packed: the wheel would only double the space.
  rm -f "$wheel"
  mkdir -p "$(dirname "$packed")"
  tar -C "$tmp/ort" -cf - . | xz -T0 -6 >"$packed.tmp"
  mv "$packed.tmp" "$packed"
fi
split -b "${part_mb}M" -d -a 2 "$packed" "$kit/ort.tar.xz."
n=0
for p in "$kit"/ort.tar.xz.*; do
  n=$((n + 1))
  mkdir -p "$kit/part-$n"
  mv "$p" "$kit/part-$n/"
done
# The tools ride in the last part if they fit beside it.
last=$(du -bc "$kit/part-$n"/* | tail -n 1 | cut -f1)
if ((last + $(stat -c %s "$kit/tools.tar.xz") > part_mb * 1024 * 1024)); then
  n=$((n + 1))
  mkdir -p "$kit/part-$n"
fi
mv "$kit/tools.tar.xz" "$kit/part-$n/"

(cd "$kit" && find . -type f ! -name manifest.txt -print0 | sort -z | xargs -0 sha256sum) >"$kit/manifest.txt"
say "kit ready in $kit:"
du -sh "$kit"/* | sed 's/^/  /'
say "on the GPU machine (each part may be its own transfer): bring $kit/part-1 .. $kit/part-$n"
say "and $kit/manifest.txt, and run: scripts/gpu-check.sh --kit $kit"
