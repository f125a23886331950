#!/usr/bin/env bash
# ONNX Runtime's GPU build and the CUDA 13 libraries its CUDA provider loads,
# from pinned PyPI wheels (sha256 checked), unpacked into the tidegate cache.
# The CUDA worker image (scripts/image.py --only worker-cuda) ships them, and
# the GPU kit (scripts/gpu-kit.sh) takes ONNX Runtime's GPU build from here.
# No GPU is needed to fetch or unpack them.
#
#   scripts/cuda-libs.sh          installs what is missing, prints the folder
#
# The set is what `pip install 'onnxruntime-gpu[cuda,cudnn]==1.31.1'` resolves
# to (the extras onnxruntime-gpu declares, and what they depend on):
#   DIR/onnxruntime/   libonnxruntime.so (GPU build), its shared and CUDA
#                      provider libraries, LICENSE, ThirdPartyNotices.txt
#   DIR/lib/           CUDA runtime, cuBLAS(Lt), cuRAND, cuFFT, nvJitLink,
#                      NVRTC 13 and cuDNN 9 (libcuda.so.1 is the driver's:
#                      the NVIDIA container toolkit mounts it at run time)
#   DIR/licenses/PKG/  each NVIDIA wheel's License.txt
# About 1.3 GB to download (a minute on a fast link) and 2.6 GB unpacked;
# the wheels are deleted once unpacked and checked.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=scripts/cache.sh
source "$here/cache.sh"
say() { printf '\033[1mcuda-libs:\033[0m %s\n' "$*" >&2; }
die() { printf 'cuda-libs: error: %s\n' "$*" >&2; exit 1; }

[ "$(uname -m)" = x86_64 ] || die "the pinned wheels are for x86_64, not $(uname -m)"

# name==version  wheel file  sha256  (pip's --platform for it)
wheels=(
  "onnxruntime-gpu==$ORT_GPU_VERSION $ORT_GPU_WHEEL $ORT_GPU_SHA256 manylinux_2_28_x86_64"
  "nvidia-cuda-runtime==13.5.37 nvidia_cuda_runtime-13.5.37-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl df2b79a8852f10d1fef8c848489c49eebb5754051bf870202a862831412b179d manylinux2014_x86_64"
  "nvidia-cublas==13.10.0.20 nvidia_cublas-13.10.0.20-py3-none-manylinux1_x86_64.manylinux_2_5_x86_64.whl dcc6d63884c53d07e267ce7e6feac17b2538cebaafec5db865736c3e28e4dc84 manylinux1_x86_64"
  "nvidia-curand==10.4.5.25 nvidia_curand-10.4.5.25-py3-none-manylinux_2_27_x86_64.whl 22bb226a857e5888fe6b54ae465fc4371296bcff13a35f79e19691bcf454f529 manylinux_2_27_x86_64"
  "nvidia-cufft==12.5.0.14 nvidia_cufft-12.5.0.14-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl b8be26837a5abad2b5b74f3e92dd29f622a42934b355be0961a48712cbba23ad manylinux2014_x86_64"
  "nvidia-nvjitlink==13.5.37 nvidia_nvjitlink-13.5.37-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl 280d7cb9649704145f074b8dbde500de04ce02d0872e066e20a83c17bcaa93eb manylinux2010_x86_64"
  "nvidia-cuda-nvrtc==13.5.37 nvidia_cuda_nvrtc-13.5.37-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl 86b4d68058807988b7d9af5b44917a0601e9c337f35ccd657bfb3c759ff8d8bc manylinux2010_x86_64"
  "nvidia-cudnn-cu13==9.28.1.4 nvidia_cudnn_cu13-9.28.1.4-py3-none-manylinux_2_27_x86_64.whl a54f205b1db1f2895d99f398754db1369816f0569dd459731f925635cf7b65ec manylinux_2_27_x86_64"
)

dir="$TIDEGATE_CACHE/cuda-libs/onnxruntime-gpu-$ORT_GPU_VERSION"
# The record of a complete unpack: every wheel's digest, in order.
want_record="$(printf '%s\n' "${wheels[@]}" | cut -d' ' -f3)"
if [ -f "$dir/complete" ] && [ "$(cat "$dir/complete")" = "$want_record" ]; then
  say "present in $dir"
  echo "$dir"
  exit 0
fi

say "fetching ONNX Runtime's GPU build and the CUDA 13 libraries (1.3 GB) into $dir"
tmp="$dir.partial"
rm -rf "$tmp"
mkdir -p "$tmp/onnxruntime" "$tmp/lib" "$tmp/licenses"
dl="$TIDEGATE_CACHE/downloads"
for w in "${wheels[@]}"; do
  read -r spec file sha plat <<<"$w"
  fetch_wheel "$spec" "$file" "$sha" "$plat" || die "cannot fetch $spec (see above)"
  pkg="${spec%%==*}"
  if [ "$pkg" = onnxruntime-gpu ]; then
    unzip -q -o -j "$dl/$file" "onnxruntime/capi/libonnxruntime.so.$ORT_GPU_VERSION" \
      'onnxruntime/capi/libonnxruntime_providers_shared.so' \
      'onnxruntime/capi/libonnxruntime_providers_cuda.so' \
      'onnxruntime/LICENSE' 'onnxruntime/ThirdPartyNotices.txt' -d "$tmp/onnxruntime"
    ln -sf "libonnxruntime.so.$ORT_GPU_VERSION" "$tmp/onnxruntime/libonnxruntime.so"
  else
    unzip -q -o -j "$dl/$file" 'nvidia/*/lib/*.so*' -d "$tmp/lib"
    mkdir -p "$tmp/licenses/$pkg"
    unzip -q -o -j "$dl/$file" '*.dist-info/licenses/License.txt' -d "$tmp/licenses/$pkg"
  fi
done
chmod 0755 "$tmp"/lib/*.so* "$tmp"/onnxruntime/*.so*
printf '%s\n' "$want_record" >"$tmp/complete"
rm -rf "$dir"
mv "$tmp" "$dir"
# Unpacked and checked: the wheels would only double the space.
for w in "${wheels[@]}"; do
  read -r _ file _ _ <<<"$w"
  rm -f "$dl/$file"
done
say "installed in $dir ($(du -sh "$dir" | cut -f1))"
echo "$dir"
