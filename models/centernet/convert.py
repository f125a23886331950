"""Converts MB3-CenterNet from the TF.js graph model in npm
@vladmandic/human@3.3.6 (models/centernet.json + centernet.bin: a MobileNetV3
backbone and CenterNet head for the 80 COCO classes, weights stored as
float16) to ONNX, with onnx and numpy only.

The 26 TensorFlow ops of the graph are mapped by hand by the shared
converter models/tools/tfjs_onnx.py (its docstring has the table); any op,
fused op, attribute value or weight encoding it does not know stops the
conversion. The convolutional trunk runs NCHW (one Transpose after the
input); the post-processing keeps TensorFlow's layout, with one Transpose
for each of the two heads it reads:
  keypoints = Sigmoid(class heatmap)  [1,128,128,80]
  peaks     = keypoints * (keypoints == MaxPool3x3(keypoints))
  TopK 100 of the flattened peaks -> index i: class i % 80,
    column i // 80 % 128, row i // 80 // 128 (integer FloorDiv/FloorMod)
  box = 4 * (column, row) -/+ the wh head (16 * [l, t, r, b]) at that cell
  detections [N,100,6] = x1, y1, x2, y2 (input pixels), score, class

Input `images` [N,512,512,3] f32, RGB 0..255 NHWC (the graph normalises
internally); output `detections` [N,100,6], N the dynamic `batch`.

Batch: the graph was frozen at batch 1, and two places carry that 1.
  - The Reshape of the peaks to [1, -1] before TopK: the converter's
    batch_dynamic option makes it [N, 128*128*80] (its leading 1 is the
    batch), and TopK on the last axis then picks 100 per image.
  - BatchGather, tf.batch_gather(wh [N,128,128,4], cells [N,100]), which
    the freezing specialised to one image: wh flattened to [16384, 4], the
    cells (row * 128 + column) to [100], GatherV2 on axis 0, a Reshape to
    [1,100,4]. For N images the flat cells would need the offset
    n * 16384 that folding at N = 1 removed. `batch_gather` maps the two
    flattening Reshapes and the GatherV2 to one GatherND with batch_dims 1:
    wh [N,16384,4] at cells [N,100,1] -> [N,100,4].
Every other op is element-wise or works per image, and a gather copies, so
each image's rows are those of a single run. The check below proves it.

The output bytes are reproducible (fixed names, opset and IR version, no
timestamps): models/fetch.sh pins their sha256. Before writing, the result is
checked with onnx.checker (full shape inference), and, when onnxruntime is
importable, on 32 random images: each run alone gives 100 rows, scores in
[0, 1] and sorted, classes whole numbers in 0..79; batches of 2, 8 and 32
must give the rows of the single runs, classes equal and values within
1e-5 (on ONNX Runtime's CPU provider they are equal bit for bit).
models/centernet/crosscheck.sh compares it with TensorFlow and tf2onnx.

Usage: convert.py SRC_DIR OUT.onnx   (SRC_DIR holds centernet.json and .bin)
"""

import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from tfjs_onnx import Converter, Value, attr, fail, convert_command  # noqa: E402

SIZE = 512
CLASSES = 80
TOP = 100
OPSET = 13
IR_VERSION = 8
PREFIX = "tower_0/"


def batch_gather(c: Converter) -> dict:
    """Handlers for Reshape and GatherV2 that map the BatchGather block per
    image (see the module docstring); every other Reshape and GatherV2 goes
    to the shared ones."""
    nodes = {n["name"]: n for n in c.graph_nodes}
    gathers = [n for n in c.graph_nodes if n["op"] == "GatherV2"]
    if len(gathers) != 1:
        fail(f"expected one GatherV2 (BatchGather), found {len(gathers)}")
    gather_node = gathers[0]
    flat = {}
    for index, role in ((0, "wh"), (1, "cells")):
        src = nodes.get(c.ref(gather_node, index), {})
        if src.get("op") != "Reshape":
            fail(f"{gather_node['name']}: input {index} is not a Reshape")
        flat[src["name"]] = role

    def reshape(node: dict) -> None:
        role = flat.get(node["name"])
        if role is None:
            c.reshape(node)
            return
        x = c.plain(c.value(node))
        target = [int(d) for d in np.ravel(c.const(node, 1))]
        base = c.short(node["name"])
        if role == "wh":
            # [N,H,W,D] -> [N,H*W,D] (the graph: [H*W, D] at N = 1).
            if len(x.shape) != 4 or x.shape[0] is not None or None in x.shape[1:] \
                    or target != [x.shape[1] * x.shape[2], x.shape[3]]:
                fail(f"{node['name']}: expected [N,H,W,D] -> [H*W,D], got {x.shape} -> {target}")
            shape = (None, target[0], target[1])
            y = c.emit("Reshape", [x.name, c.init(f"{base}/shape",
                                                  np.array([0] + target, np.int64))], base)
        else:
            # Cells [N,K] -> [N,K,1], int64 for GatherND (the graph: [K] at N = 1).
            if len(x.shape) != 2 or x.shape[0] is not None or target != [-1] \
                    or not np.issubdtype(x.dtype, np.integer):
                fail(f"{node['name']}: expected integer cells [N,K] -> [-1], got "
                     f"{np.dtype(x.dtype)} {x.shape} -> {target}")
            shape = (None, x.shape[1], 1)
            cells = c.emit("Cast", [x.name], f"{base}/int64", to=TensorProto.INT64)
            y = c.emit("Unsqueeze", [cells, c.init(f"{base}/axes", np.array([2], np.int64))],
                       base)
        c.put(node, y, shape, np.int64 if role == "cells" else x.dtype, False)

    def gather(node: dict) -> None:
        if node is not gather_node:
            c.gather(node)
            return
        wh, cells = c.value(node, 0), c.value(node, 1)
        if int(c.const(node, 2)) != 0 or attr(node, "batch_dims", "i", 0) != 0:
            fail(f"{node['name']}: expected GatherV2 on axis 0 without batch_dims")
        # Per image n: wh[n, cells[n, k], :], as the graph does for n = 0.
        y = c.emit("GatherND", [wh.name, cells.name], c.short(node["name"]), batch_dims=1)
        c.put(node, y, (None, cells.shape[1], wh.shape[2]), wh.dtype, False)

    return {"Reshape": reshape, "GatherV2": gather}


def convert(src_dir: str) -> onnx.ModelProto:
    c = Converter(src_dir, "centernet", PREFIX, batch_dynamic=True)
    inputs = [n for n in c.graph_nodes if n["op"] == "Placeholder"]
    dims = [[int(d.get("size", 0)) for d in n["attr"]["shape"]["shape"]["dim"]] for n in inputs]
    if dims != [[1, SIZE, SIZE, 3]] or inputs[0]["attr"]["dtype"]["type"] != "DT_FLOAT":
        fail(f"inputs are {dims}, expected one [1,{SIZE},{SIZE},3] float")
    if inputs[0]["name"] != PREFIX + "images":
        fail(f"the input is {inputs[0]['name']}, expected {PREFIX}images")
    # The graph's batch of 1 becomes an unknown batch (see the docstring).
    c.values[inputs[0]["name"]] = Value("images", (None, SIZE, SIZE, 3), np.float32)

    c.convert(batch_gather(c))
    out = c.values.get(PREFIX + "detections")
    if out is None or out.shape != (None, TOP, 6) or out.dtype != np.float32:
        fail(f"the output {PREFIX}detections is {out}, expected [N,{TOP},6] float")
    c.emit("Identity", [c.plain(out).name], "detections")
    return c.model(
        "centernet",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", SIZE, SIZE, 3])],
        [helper.make_tensor_value_info("detections", TensorProto.FLOAT, ["batch", TOP, 6])],
        OPSET, IR_VERSION, "tidegate models/centernet/convert.py",
        "MB3-CenterNet (MobileNetV3 + CenterNet head, COCO) from npm @vladmandic/human@3.3.6 "
        "models/centernet.json. Input: RGB NHWC 0..255, 512x512, any batch. Output: per "
        "image, the top 100 centres as x1, y1, x2, y2 (input pixels), score, class (0-based "
        "COCO index).")


def check_rows(rows: np.ndarray) -> None:
    """One image's 100 rows: sorted scores in [0, 1], classes in 0..79."""
    scores, classes = rows[:, 4], rows[:, 5]
    if not (np.all(scores >= 0) and np.all(scores <= 1) and np.all(np.diff(scores) <= 0)):
        fail(f"scores are not sorted probabilities: {scores[:5]}...")
    if not np.array_equal(classes, np.round(classes)) or classes.min() < 0 \
            or classes.max() >= CLASSES:
        fail(f"classes are not indices in 0..{CLASSES - 1}: {classes[:5]}...")


def check_batches(path: str) -> float:
    """Checks single runs on 32 random images, then batches of 2, 8 and 32
    against them; returns the largest |batch - single| (0 when equal)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    s = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    frames = np.random.default_rng(7).integers(0, 256, (32, SIZE, SIZE, 3)).astype(np.float32)
    singles = np.concatenate([s.run(None, {"images": frames[i:i + 1]})[0] for i in range(32)])
    if singles.shape != (32, TOP, 6):
        fail(f"single runs give shape {singles.shape[1:]}")
    for rows in singles:
        check_rows(rows)
    worst = 0.0
    for n in (2, 8, 32):
        got = s.run(None, {"images": frames[:n]})[0]
        if got.shape != (n, TOP, 6):
            fail(f"batch {n} gives shape {got.shape}")
        if not np.array_equal(got[:, :, 5], singles[:n, :, 5]):
            fail(f"batch {n}: classes or their order differ from single runs")
        diff = float(np.max(np.abs(got - singles[:n])))
        # NaN compares false: `not <=` fails it, where `>` and max() would
        # pass it by.
        if not diff <= 1e-5:
            fail(f"batch {n} outputs differ from single runs by {diff}")
        worst = max(worst, diff)
    return worst


if __name__ == "__main__":
    convert_command(convert, check_batches)
