# Shared by scripts/setup.sh and models/fetch.sh: where tidegate keeps what it
# downloads, and how a download is checked. tidegate-worker looks for ONNX
# Runtime in the same place (cloud-worker/src/runtime.rs), so nothing needs
# exporting.
TIDEGATE_CACHE="${TIDEGATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tidegate}"
export TIDEGATE_CACHE

# verify_sha256 FILE EXPECTED: removes FILE and fails when its digest differs.
verify_sha256() {
  local file="$1" want="$2" got
  got="$(sha256sum "$file" | cut -d' ' -f1)"
  if [ "$got" != "$want" ]; then
    rm -f "$file"
    printf 'checksum mismatch for %s\n  expected %s\n  got      %s\nThe file was removed; re-run make setup to download it again.\n' \
      "$file" "$want" "$got" >&2
    return 1
  fi
}

# fetch_npm SPEC TARBALL SHA256: `npm pack`s SPEC into the downloads folder of
# the cache unless TARBALL is already there with that digest, then checks it.
fetch_npm() {
  local spec="$1" tarball="$2" sha="$3" dl="$TIDEGATE_CACHE/downloads"
  mkdir -p "$dl"
  if [ -f "$dl/$tarball" ] && [ "$(sha256sum "$dl/$tarball" | cut -d' ' -f1)" = "$sha" ]; then
    return 0
  fi
  printf 'downloading %s from npm\n' "$spec" >&2
  (cd "$dl" && npm pack --silent "$spec" >/dev/null) || {
    printf 'npm pack %s failed; check access to the npm registry and re-run\n' "$spec" >&2
    return 1
  }
  verify_sha256 "$dl/$tarball" "$sha"
}

# fetch_wheel SPEC WHEEL SHA256 [PLATFORM]: `pip download`s SPEC (a wheel for
# CPython 3.11 on PLATFORM, default manylinux_2_28_x86_64) into the downloads
# folder of the cache unless WHEEL is already there, then checks its digest.
fetch_wheel() {
  local spec="$1" wheel="$2" sha="$3" platform="${4:-manylinux_2_28_x86_64}"
  local dl="$TIDEGATE_CACHE/downloads"
  mkdir -p "$dl"
  if [ ! -f "$dl/$wheel" ]; then
    printf 'downloading %s from PyPI\n' "$spec" >&2
    python3 -m pip download --quiet --no-deps --only-binary=:all: \
      --python-version 3.11 --platform "$platform" -d "$dl" "$spec" || {
      printf "pip download %s failed; check access to PyPI and re-run 'make setup'\n" "$spec" >&2
      return 1
    }
  fi
  verify_sha256 "$dl/$wheel" "$sha"
}

# ONNX Runtime's GPU build (PyPI onnxruntime-gpu, MIT): the CUDA worker image
# (scripts/cuda-libs.sh) and the GPU kit (scripts/gpu-kit.sh).
ORT_GPU_VERSION=1.31.1
ORT_GPU_WHEEL="onnxruntime_gpu-$ORT_GPU_VERSION-cp311-cp311-manylinux_2_28_x86_64.whl"
ORT_GPU_SHA256=e26c475fe361b2015f45b4b824bd13f0bb20204e59b62814e6f0acd5f3d491a6

# npm @vladmandic/human@3.3.6 (MIT, 28 MB): the emotion classifier and CenterNet
# (make setup, models/fetch.sh) are TF.js graph models in it.
HUMAN_NPM="@vladmandic/human@3.3.6"
HUMAN_TGZ="vladmandic-human-3.3.6.tgz"
HUMAN_SHA256=425e9c51dbbca0c8934362b170cb0d54c2529c11c654b3c03092b16e9d6ad3f7

# fetch_deb PACKAGE VERSION SHA256: `apt-get download`s PACKAGE=VERSION into
# the downloads folder of the cache, unless a .deb of it with that digest is
# already there, checks the digest and prints the file's path. apt checks the
# archive's signature; the digest pins the exact file. The package lists may
# be missing (setup found every package installed and did not refresh them):
# then they are refreshed once and the download retried.
fetch_deb() {
  local pkg="$1" ver="$2" sha="$3" dl="$TIDEGATE_CACHE/downloads" f sudo=""
  mkdir -p "$dl"
  for f in "$dl/${pkg}_${ver}"_*.deb; do
    if [ -f "$f" ] && [ "$(sha256sum "$f" | cut -d' ' -f1)" = "$sha" ]; then
      printf '%s\n' "$f"
      return 0
    fi
  done
  printf 'downloading the Debian package %s=%s\n' "$pkg" "$ver" >&2
  if ! (cd "$dl" && apt-get download -q "$pkg=$ver" >&2); then
    if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
    if ! { $sudo apt-get update -qq >&2 && (cd "$dl" && apt-get download -q "$pkg=$ver" >&2); }; then
      printf 'apt-get download %s=%s failed; the pin is from Debian 12 (bookworm) main: check your network or apt sources, then re-run make setup\n' "$pkg" "$ver" >&2
      return 1
    fi
  fi
  for f in "$dl/${pkg}_${ver}"_*.deb; do
    verify_sha256 "$f" "$sha" || return 1
    printf '%s\n' "$f"
    return 0
  done
  printf 'apt-get download %s=%s wrote no .deb in %s\n' "$pkg" "$ver" "$dl" >&2
  return 1
}

# pinned_venv NAME REQUIREMENTS [PIP_ARGS...]: prints the python of a venv in
# the cache holding exactly the files of REQUIREMENTS (each pinned with its
# sha256: pip --require-hashes, wheels only), creating it once per
# requirements file (`$TIDEGATE_CACHE/venv/NAME-<digest>`). Fails, saying
# why, when the venv or the install cannot be made.
pinned_venv() {
  local name="$1" req="$2" venv
  shift 2
  venv="$TIDEGATE_CACHE/venv/$name-$(sha256sum "$req" | cut -c1-12)"
  if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
    printf 'creating %s (pinned with sha256)\n' "$venv" >&2
    rm -rf "$venv"
    python3 -m venv "$venv" || {
      printf 'python3 -m venv failed; install python3-venv (make setup does) and re-run\n' >&2
      return 1
    }
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
      --require-hashes --only-binary=:all: "$@" -r "$req" >&2 || {
      printf 'pip install -r %s failed (CPython 3.11 wheels for x86_64 Linux; check access to PyPI) and re-run\n' "$req" >&2
      return 1
    }
    touch "$venv/.complete"
  fi
  printf '%s\n' "$venv/bin/python"
}
