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
