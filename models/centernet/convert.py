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
  detections [1,100,6] = x1, y1, x2, y2 (input pixels), score, class

Input `images` [1,512,512,3] f32, RGB 0..255 NHWC (the graph normalises
internally); output `detections` [1,100,6]. The batch is fixed at 1, as in
the graph (its gather reshapes carry the 1).

The output bytes are reproducible (fixed names, opset and IR version, no
timestamps): models/fetch.sh pins their sha256. Before writing, the result is
checked with onnx.checker (full shape inference), and, when onnxruntime is
importable, run once on a random image: 100 rows, scores in [0, 1] and
sorted, classes whole numbers in 0..79.
models/centernet/crosscheck.sh compares it with TensorFlow and tf2onnx.

Usage: convert.py SRC_DIR OUT.onnx   (SRC_DIR holds centernet.json and .bin)
"""

import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from tfjs_onnx import Converter, Value, fail, main_guard  # noqa: E402

SIZE = 512
CLASSES = 80
TOP = 100
OPSET = 13
IR_VERSION = 8
PREFIX = "tower_0/"


def convert(src_dir: str) -> onnx.ModelProto:
    c = Converter(src_dir, "centernet", PREFIX)
    inputs = [n for n in c.graph_nodes if n["op"] == "Placeholder"]
    dims = [[int(d.get("size", 0)) for d in n["attr"]["shape"]["shape"]["dim"]] for n in inputs]
    if dims != [[1, SIZE, SIZE, 3]] or inputs[0]["attr"]["dtype"]["type"] != "DT_FLOAT":
        fail(f"inputs are {dims}, expected one [1,{SIZE},{SIZE},3] float")
    if inputs[0]["name"] != PREFIX + "images":
        fail(f"the input is {inputs[0]['name']}, expected {PREFIX}images")
    c.values[inputs[0]["name"]] = Value("images", (1, SIZE, SIZE, 3), np.float32)

    c.convert()
    out = c.values.get(PREFIX + "detections")
    if out is None or out.shape != (1, TOP, 6) or out.dtype != np.float32:
        fail(f"the output {PREFIX}detections is {out}, expected [1,{TOP},6] float")
    c.emit("Identity", [c.plain(out).name], "detections")
    return c.model(
        "centernet",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, SIZE, SIZE, 3])],
        [helper.make_tensor_value_info("detections", TensorProto.FLOAT, [1, TOP, 6])],
        OPSET, IR_VERSION, "tidegate models/centernet/convert.py",
        "MB3-CenterNet (MobileNetV3 + CenterNet head, COCO) from npm @vladmandic/human@3.3.6 "
        "models/centernet.json. Input: RGB NHWC 0..255, 512x512. Output: the top 100 "
        "centres as x1, y1, x2, y2 (input pixels), score, class (0-based COCO index).")


def check_run(path: str) -> None:
    """Runs the model once on a random image and checks the rows' form."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    s = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    image = np.random.default_rng(7).integers(0, 256, (1, SIZE, SIZE, 3)).astype(np.float32)
    (rows,) = s.run(None, {"images": image})
    if rows.shape != (1, TOP, 6):
        fail(f"the output has shape {rows.shape}")
    scores, classes = rows[0, :, 4], rows[0, :, 5]
    if not (np.all(scores >= 0) and np.all(scores <= 1) and np.all(np.diff(scores) <= 0)):
        fail(f"scores are not sorted probabilities: {scores[:5]}...")
    if not np.array_equal(classes, np.round(classes)) or classes.min() < 0 \
            or classes.max() >= CLASSES:
        fail(f"classes are not indices in 0..{CLASSES - 1}: {classes[:5]}...")


def main() -> None:
    if len(sys.argv) != 3:
        fail("usage: convert.py SRC_DIR OUT.onnx")
    src_dir, out = sys.argv[1], sys.argv[2]
    model = convert(src_dir)
    onnx.save(model, out + ".tmp")
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        note = "onnxruntime not installed; run check skipped"
    else:
        check_run(out + ".tmp")
        note = "a random image gives 100 sorted rows of known classes"
    os.replace(out + ".tmp", out)
    print(f"convert.py: wrote {out} ({len(model.graph.node)} nodes); {note}")


if __name__ == "__main__":
    main_guard("convert.py", main)
