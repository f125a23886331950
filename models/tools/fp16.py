"""Builds a model's half-precision variant (runtime.precision = "fp16").

    python fp16.py SRC.onnx DST.onnx [--check values|finite]

Weights and activations become FP16; the graph's inputs and outputs stay
FP32 (keep_io_types), so the worker's preprocessing and decoders serve it
as they serve SRC. The converter is onnxconverter-common's, pinned in
requirements.txt; its output is reproducible and models/fetch.sh pins its
sha256.

One repair follows the conversion: a Cast to FP32 whose output the
converter typed FP16 (it feeds FP16 ops, as CenterNet's mask Cast feeds a
Mul of the FP16 heatmap) casts to FP16, or ONNX Runtime refuses the graph.

Before writing, the variant is run beside SRC on ONNX Runtime's CPU
provider, on the same seeded inputs at batch 1 and 4, and refused unless
every output has SRC's shape and type and is finite, and (--check values,
the default) within a tolerance of SRC's. FP16 keeps about three
significant digits. For a graph that ends in a top-k of detections
(CenterNet) random inputs give near-equal scores whose order FP16 may
swap, so --check finite leaves the comparison to the worker's tests on
real images (cloud-worker/tests/blazeface.rs and centernet.rs compare the
decoded detections of both).
"""

import argparse
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnxconverter_common import float16

# Largest |fp16 - fp32| accepted, relative to the output's own range.
TOLERANCE = 0.02


def session(model):
    """`model` (a path, or a serialised graph) on ONNX Runtime's CPU provider."""
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--check", choices=("values", "finite"), default="values")
    args = ap.parse_args()
    model = onnx.load(args.src)
    half = float16.convert_float_to_float16(model, keep_io_types=True)
    typed = {v.name: v.type.tensor_type.elem_type for v in half.graph.value_info}
    for node in half.graph.node:
        if node.op_type != "Cast":
            continue
        to = next(a for a in node.attribute if a.name == "to")
        if to.i == onnx.TensorProto.FLOAT and typed.get(node.output[0]) == onnx.TensorProto.FLOAT16:
            to.i = onnx.TensorProto.FLOAT16
    onnx.checker.check_model(half)
    full_run, half_run = session(args.src), session(half.SerializeToString())
    graph_input = model.graph.input[0]
    dims = [d.dim_value for d in graph_input.type.tensor_type.shape.dim]
    rng = np.random.RandomState(20)
    worst = 0.0
    for batch in (1, 4):
        shape = [batch] + [d for d in dims[1:]]
        x = rng.uniform(0.0, 1.0, size=shape).astype(np.float32)
        feeds = {graph_input.name: x}
        for i, (a, b) in enumerate(zip(full_run.run(None, feeds), half_run.run(None, feeds))):
            if a.shape != b.shape or a.dtype != b.dtype:
                sys.exit(f"fp16: output {i}: {b.dtype}{b.shape}, FP32 gives {a.dtype}{a.shape}")
            if not np.isfinite(b).all():
                sys.exit(f"fp16: output {i} at batch {batch} is not finite")
            if args.check == "finite":
                continue
            span = max(float(np.abs(a).max()), 1e-6)
            err = float(np.abs(a - b).max()) / span
            worst = max(worst, err)
            if err > TOLERANCE:
                sys.exit(
                    f"fp16: output {i} at batch {batch} differs from FP32 by {err:.4f} "
                    f"of its range (at most {TOLERANCE})"
                )
    onnx.save(half, args.dst)
    if args.check == "finite":
        print(f"fp16: {args.dst}: outputs finite, shaped and typed as FP32's at batch 1 and 4")
    else:
        print(f"fp16: {args.dst}: outputs within {worst:.4f} of FP32's range at batch 1 and 4")


if __name__ == "__main__":
    main()
