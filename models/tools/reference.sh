# Sourced by the development cross-checks (models/*/crosscheck.sh) after
# scripts/cache.sh. reference_python prints the python of a venv in the cache
# holding the pinned TensorFlow and tf2onnx of reference-requirements.txt,
# creating it on first use (about 300 MB of wheels from PyPI). Neither make
# setup nor make test uses it.
reference_python() {
  local req venv
  req="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/reference-requirements.txt"
  venv="$TIDEGATE_CACHE/venv/reference-$(sha256sum "$req" | cut -c1-12)"
  if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
    printf 'creating %s (tensorflow-cpu 2.15.1, tf2onnx 1.16.1; pinned with sha256; ~300 MB)\n' \
      "$venv" >&2
    rm -rf "$venv"
    python3 -m venv "$venv" || {
      printf 'python3 -m venv failed; install python3-venv (make setup does)\n' >&2
      return 1
    }
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
      --require-hashes --only-binary=:all: -r "$req" >&2 || {
      printf 'pip install -r %s failed (CPython 3.11 wheels for x86_64 Linux; PyPI access)\n' "$req" >&2
      return 1
    }
    touch "$venv/.complete"
  fi
  printf '%s\n' "$venv/bin/python"
}
