#!/usr/bin/env bash
# Development check of models/centernet/model.onnx against TensorFlow and
# tf2onnx (crosscheck.py, on astronaut.png, the vtest frames and random
# images); see models/tools/crosscheck.sh. Not run by make setup or make test.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
exec "$root/models/tools/crosscheck.sh" centernet "$root/models/testdata/astronaut.png" "$root/models/testdata/vtest"
