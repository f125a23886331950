"""Converts the facial-expression classifier in npm @vladmandic/human@3.3.6
(models/emotion.json + emotion.bin: oarriaga's mini-XCEPTION trained on
FER2013, a TF.js graph model) to ONNX, with onnx and numpy only.

The graph is small and uses ten TensorFlow ops, mapped by hand by the
shared converter models/tools/tfjs_onnx.py (its docstring has the table):
  Placeholder input_1 [-1,64,64,1] (gray, NHWC)  -> see "Input" below
  _FusedConv2D (BiasAdd[, Relu])                 -> Conv (+ Relu)
  DepthwiseConv2dNative                          -> Conv, group = channels
  MaxPool                                        -> MaxPool
  AddV2, Relu                                    -> Add, Relu
  Mean over H, W (keep_dims false)               -> GlobalAveragePool + Flatten
  Softmax, Identity                              -> Softmax (output "emotion"; here)
  Const                                          -> initializers (emotion.bin)
Any other op, fused op, padding, dilation or weight encoding stops the
conversion.

Layout: the ONNX graph is NCHW throughout, with one Transpose at the input;
TF's SAME padding becomes explicit pads computed from the static 64x64
shapes, so nothing depends on a runtime's auto_pad.

Input: tidegate frames are RGB, and human feeds the model
    gray = 0.2989 R + 0.5870 G + 0.1140 B   (R, G, B in 0..1)
    x    = (gray - 0.5) * 2.
The ONNX input `image` is [batch,64,64,3] RGB, each channel already
normalised by the worker to v = (pixel/255 - 0.5) / 0.5 (model.toml's
[input.normalize]); a fixed 1x1 Conv then computes
    x = 0.2989 v_R + 0.5870 v_G + 0.1140 v_B + (0.9999 - 1),
whose bias folds in the weights summing to 0.9999 rather than 1, so x equals
human's value exactly (up to float rounding).

The output bytes are reproducible (fixed names, opset and IR version, no
timestamps): models/fetch.sh pins their sha256. Before writing, the result is
checked with onnx.checker (full shape inference), and, when onnxruntime is
importable, batch-N outputs are compared with N single runs.

Usage: convert.py SRC_DIR OUT.onnx   (SRC_DIR holds emotion.json and .bin)
"""

import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from tfjs_onnx import Converter, Value, fail, convert_command  # noqa: E402

SIZE = 64
LABELS = ["angry", "disgust", "fear", "happy", "sad", "surprise", "neutral"]
GRAY = [0.2989, 0.5870, 0.1140]
OPSET = 13
IR_VERSION = 8
PREFIX = "StatefulPartitionedCall/model_1/"


def convert(src_dir: str) -> onnx.ModelProto:
    c = Converter(src_dir, "emotion", PREFIX)
    inputs = [n for n in c.graph_nodes if n["op"] == "Placeholder"]
    dims = [[int(d.get("size", 0)) for d in n["attr"]["shape"]["shape"]["dim"]] for n in inputs]
    if dims != [[-1, SIZE, SIZE, 1]] or inputs[0]["attr"]["dtype"]["type"] != "DT_FLOAT":
        fail(f"inputs are {dims}, expected one [-1,{SIZE},{SIZE},1] float")

    # Input: NHWC RGB, already normalised per channel -> NCHW -> gray.
    nchw = c.emit("Transpose", ["image"], "image/nchw", perm=[0, 3, 1, 2])
    gray_w = np.array(GRAY, np.float32).reshape(1, 3, 1, 1)
    gray_b = np.array([gray_w.sum(dtype=np.float32) - np.float32(1)], np.float32)
    gray = c.emit("Conv", [nchw, c.init("gray/W", gray_w), c.init("gray/B", gray_b)], "gray",
                  kernel_shape=[1, 1])
    c.values[inputs[0]["name"]] = Value(gray, (None, SIZE, SIZE, 1), np.float32, nchw=True)

    def softmax(node: dict) -> None:
        x = c.value(node)
        if x.shape != (None, len(LABELS)) or x.nchw:
            fail(f"{node['name']}: {x.shape} scores, expected {len(LABELS)}")
        c.put(node, c.emit("Softmax", [x.name], "emotion", axis=1), x.shape, x.dtype, False)

    c.convert({"Softmax": softmax})
    if c.values.get("Identity", Value("", (), None)).name != "emotion":
        fail("the graph does not end in Softmax -> Identity")
    return c.model(
        "emotion",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", SIZE, SIZE, 3])],
        [helper.make_tensor_value_info("emotion", TensorProto.FLOAT, ["batch", len(LABELS)])],
        OPSET, IR_VERSION, "tidegate models/emotion/convert.py",
        "Facial expression (FER2013 mini-XCEPTION, oarriaga/face_classification) from npm "
        "@vladmandic/human@3.3.6 models/emotion.json. Input: RGB NHWC, each channel "
        "(pixel/255 - 0.5)/0.5. Output: softmax over " + ", ".join(LABELS) + ".")


def check_batches(path: str) -> float:
    """Largest |batch-N output - single-run output| over N = 2, 8, 32."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    s = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    frames = (rng.integers(0, 256, (32, SIZE, SIZE, 3)).astype(np.float32) - 127.5) / 127.5
    singles = np.concatenate([s.run(None, {"image": frames[i:i + 1]})[0] for i in range(32)])
    if not np.allclose(singles.sum(axis=1), 1.0, atol=1e-5):
        fail("outputs do not sum to 1")
    worst = 0.0
    for n in (2, 8, 32):
        got = s.run(None, {"image": frames[:n]})[0]
        if got.shape != (n, len(LABELS)):
            fail(f"batch {n} gives shape {got.shape}")
        diff = float(np.max(np.abs(got - singles[:n])))
        # NaN compares false: `not <=` fails it, where `>` and max() would
        # pass it by.
        if not diff <= 1e-5:
            fail(f"batch {n} outputs differ from single runs by {diff}")
        worst = max(worst, diff)
    return worst


if __name__ == "__main__":
    convert_command(convert, check_batches)
