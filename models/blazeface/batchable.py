"""Rewrites BlazeFace's fixed batch of 1 into a symbolic `batch` dimension,
then proves the rewrite changes nothing: batch-N outputs must equal N single
runs of the original graph.

The npm graph (converted from TF Lite by tf2onnx) bakes the batch of 1 in
three places, and each is rewritten:
  1. the input and the four outputs declare dim 0 = 1  -> dim_param "batch";
  2. channel padding is Concat(x, ConstantOfShape([1,C,H,W]))
                                                       -> Pad(x) on axis 1;
  3. the four output Reshapes use constants [1, anchors, k] -> [-1, anchors, k].
The shapes tf2onnx recorded for intermediate values (value_info) all carry the
batch of 1 and are dropped; ONNX Runtime infers them again.

Usage: batchable.py SOURCE.onnx OUT.onnx   (exit 1 when the check fails)
Run by models/fetch.sh with pinned onnx/onnxruntime/numpy (tools/requirements.txt).
"""

import sys

import numpy as np
import onnx
from onnx import helper, numpy_helper

# Largest batch checked, and the tolerance for "equal": the same kernels run
# on every image of a batch, so differences should be 0 or a few ulps.
CHECK_BATCH = 32
TOLERANCE = 1e-5


def fail(message: str):
    """Stops with `batchable.py: message`, exit 1. (Not `assert`: checks
    must hold under `python -O` too.)"""
    sys.exit(f"batchable.py: {message}")


def rewrite(model: onnx.ModelProto) -> onnx.ModelProto:
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    for vi in list(g.input) + list(g.output):
        dim = vi.type.tensor_type.shape.dim[0]
        if dim.dim_value != 1:
            fail(f"{vi.name}: batch dim is {dim}, expected 1")
        dim.Clear()
        dim.dim_param = "batch"

    producers = {o: n for n in g.node for o in n.output}
    new_nodes, dropped, pads = [], set(), 0
    for n in g.node:
        if n.op_type == "Concat" and len(n.input) == 2 and n.input[1] in producers \
                and producers[n.input[1]].op_type == "ConstantOfShape":
            zeros = producers[n.input[1]]
            shape = numpy_helper.to_array(inits[zeros.input[0]]).tolist()
            axis = helper.get_attribute_value(n.attribute[0])
            if not (axis == 1 and shape[0] == 1 and not zeros.attribute):
                fail(f"padding Concat {n.name}: axis {axis}, zeros of shape {shape}, "
                     f"expected axis 1 and [1, C, H, W] zeros")
            pads_name = f"{n.output[0]}__pads"
            # Pads: begin of N, C, H, W then end of N, C, H, W.
            pads_value = np.array([0, 0, 0, 0, 0, shape[1], 0, 0], dtype=np.int64)
            g.initializer.append(numpy_helper.from_array(pads_value, pads_name))
            new_nodes.append(helper.make_node(
                "Pad", [n.input[0], pads_name], list(n.output), name=f"{n.name or n.output[0]}__pad",
                mode="constant"))
            dropped.add(zeros.output[0])
            pads += 1
            continue
        if n.op_type == "Reshape" and n.input[1] in inits:
            target = numpy_helper.to_array(inits[n.input[1]])
            if target.size and target[0] == 1:
                fixed = target.copy()
                fixed[0] = -1
                name = f"{n.input[1]}__batch"
                g.initializer.append(numpy_helper.from_array(fixed, name))
                n.input[1] = name
        new_nodes.append(n)
    kept = [n for n in new_nodes if not (n.op_type == "ConstantOfShape" and n.output[0] in dropped)]
    if pads != 11:
        fail(f"expected 11 padding Concats, found {pads}")
    del g.node[:]
    g.node.extend(kept)
    del g.value_info[:]
    used = {i for n in g.node for i in n.input}
    unused = [t for t in g.initializer if t.name not in used]
    for t in unused:
        g.initializer.remove(t)
    onnx.checker.check_model(model)
    return model


def check(source: str, rewritten: str) -> float:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    a = ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(rewritten, opts, providers=["CPUExecutionProvider"])
    name = a.get_inputs()[0].name
    rng = np.random.default_rng(7)
    # Pixels as the worker feeds them: u8 normalised to [-1, 1].
    frames = (rng.integers(0, 256, (CHECK_BATCH, 128, 128, 3)).astype(np.float32) - 127.5) / 127.5
    singles = [a.run(None, {name: frames[i:i + 1]}) for i in range(CHECK_BATCH)]
    worst = 0.0
    for n in (1, 2, 8, CHECK_BATCH):
        batched = b.run(None, {name: frames[:n]})
        for out, got in enumerate(batched):
            if got.shape[0] != n:
                fail(f"output {out} has batch {got.shape[0]}, expected {n}")
            for i in range(n):
                want = singles[i][out][0]
                if not np.all(np.isfinite(want)):
                    fail(f"single run {i} output {out} holds NaN or infinity")
                diff = float(np.max(np.abs(got[i] - want)))
                # NaN compares false: `not <=` fails it, where `>` would pass it.
                if not diff <= TOLERANCE:
                    fail(f"batch {n} frame {i} output {out} differs by {diff}")
                worst = max(worst, diff)
    return worst


def main() -> None:
    source, out = sys.argv[1], sys.argv[2]
    model = rewrite(onnx.load(source))
    model.producer_name = "tidegate models/blazeface/batchable.py"
    onnx.save(model, out)
    worst = check(source, out)
    print(f"batchable.py: batch 1/2/8/{CHECK_BATCH} outputs equal single runs (max |diff| {worst:g})")


if __name__ == "__main__":
    main()
