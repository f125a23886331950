# Sourced by the development cross-checks (models/*/crosscheck.sh) after
# scripts/cache.sh. reference_python prints the python of a venv in the cache
# holding the pinned TensorFlow and tf2onnx of reference-requirements.txt,
# creating it on first use (about 300 MB of wheels from PyPI). Neither make
# setup nor make test uses it.
reference_python() {
  # tensorflow-cpu 2.15.1, tf2onnx 1.16.1: about 300 MB.
  pinned_venv reference "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/reference-requirements.txt"
}
