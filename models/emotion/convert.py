"""Converts the facial-expression classifier in npm @vladmandic/human@3.3.6
(models/emotion.json + emotion.bin: oarriaga's mini-XCEPTION trained on
FER2013, a TF.js graph model) to ONNX, with onnx and numpy only.

The graph is small and uses ten TensorFlow ops, each mapped by hand:
  Placeholder input_1 [-1,64,64,1] (gray, NHWC)  -> see "Input" below
  _FusedConv2D (BiasAdd[, Relu])                 -> Conv (+ Relu)
  DepthwiseConv2dNative                          -> Conv, group = channels
  MaxPool                                        -> MaxPool
  AddV2, Relu                                    -> Add, Relu
  Mean over H, W (keep_dims false)               -> GlobalAveragePool + Flatten
  Softmax, Identity                              -> Softmax (output "emotion")
  Const                                          -> initializers (emotion.bin)
Any other op, fused op, padding, dilation or weight encoding stops the
conversion.

Layout: the ONNX graph is NCHW throughout, with one Transpose at the input.
TF Conv2D weights [H,W,in,out] become [out,in,H,W]; depthwise weights
[H,W,in,mult] become [in*mult,1,H,W] (output channel g*mult+m, as in TF).
TF's SAME padding becomes explicit pads computed from the static 64x64
shapes (total = max((out-1)*stride + k - in, 0), the odd pixel at the end),
so nothing depends on a runtime's auto_pad.

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

import base64
import json
import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SIZE = 64
LABELS = ["angry", "disgust", "fear", "happy", "sad", "surprise", "neutral"]
GRAY = [0.2989, 0.5870, 0.1140]
OPSET = 13
IR_VERSION = 8
PREFIX = "StatefulPartitionedCall/model_1/"
DTYPES = {"float32": np.float32, "int32": np.int32}


def fail(message: str) -> None:
    sys.exit(f"convert.py: {message}")


def read_weights(src_dir: str, manifest: list) -> dict:
    """Weights by name, read in manifest order from the concatenated shards."""
    weights = {}
    for group in manifest:
        data = b"".join(open(os.path.join(src_dir, p), "rb").read() for p in group["paths"])
        offset = 0
        for w in group["weights"]:
            if "quantization" in w or w["dtype"] not in DTYPES:
                fail(f"weight {w['name']}: unsupported encoding {w}")
            dtype = np.dtype(DTYPES[w["dtype"]]).newbyteorder("<")
            count = int(np.prod(w["shape"], dtype=np.int64))
            size = count * dtype.itemsize
            if offset + size > len(data):
                fail(f"weight {w['name']} runs past the end of {group['paths']}")
            array = np.frombuffer(data, dtype, count, offset).reshape(w["shape"])
            weights[w["name"]] = array.astype(dtype.newbyteorder("="))
            offset += size
        if offset != len(data):
            fail(f"{group['paths']}: {len(data) - offset} bytes left after the last weight")
    return weights


def attr(node: dict, name: str, kind: str, default=None):
    value = node.get("attr", {}).get(name)
    if value is None:
        return default
    if kind == "s":
        return base64.b64decode(value["s"]).decode()
    if kind == "ints":
        return [int(i) for i in value["list"].get("i", [])]
    if kind == "strs":
        return [base64.b64decode(s).decode() for s in value["list"].get("s", [])]
    if kind == "b":
        return bool(value["b"])
    if kind == "i":
        return int(value["i"])
    fail(f"unknown attribute kind {kind}")


def short(name: str) -> str:
    return name[len(PREFIX):] if name.startswith(PREFIX) else name


class Builder:
    """Emits ONNX nodes while tracking each value's static [C, H, W]."""

    def __init__(self, weights: dict):
        self.weights = weights
        self.nodes = []
        self.inits = []
        self.shapes = {}
        self.values = {}

    def init(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def weight(self, node: dict, index: int) -> np.ndarray:
        name = node["input"][index]
        if name not in self.weights:
            fail(f"{node['name']}: input {name} is not a weight")
        return self.weights[name]

    def source(self, node: dict, index: int = 0) -> str:
        name = node["input"][index]
        if name not in self.values:
            fail(f"{node['name']}: input {name} is not computed before it")
        return self.values[name]

    def emit(self, op: str, inputs: list, output: str, shape, **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, [output], name=output, **attrs))
        self.shapes[output] = shape
        return output

    def check_common(self, node: dict) -> None:
        if attr(node, "data_format", "s", "NHWC") != "NHWC":
            fail(f"{node['name']}: data_format must be NHWC")
        if any(d != 1 for d in attr(node, "dilations", "ints", [1, 1, 1, 1])):
            fail(f"{node['name']}: dilations are not supported")
        if attr(node, "explicit_paddings", "ints", []):
            fail(f"{node['name']}: explicit_paddings are not supported")

    def window(self, node: dict, x: str, k: list, strides: list):
        """Output [H, W] and ONNX pads for a kh x kw window over x."""
        padding = attr(node, "padding", "s")
        _, h, w = self.shapes[x]
        out, pads = [], [0, 0, 0, 0]
        for axis, (size, kk, s) in enumerate(zip((h, w), k, strides)):
            if padding == "VALID":
                out.append((size - kk) // s + 1)
            elif padding == "SAME":
                o = -(-size // s)
                total = max((o - 1) * s + kk - size, 0)
                pads[axis], pads[axis + 2] = total // 2, total - total // 2
                out.append(o)
            else:
                fail(f"{node['name']}: padding {padding!r} is not supported")
        return out, pads

    def strides(self, node: dict) -> list:
        s = attr(node, "strides", "ints", [1, 1, 1, 1])
        if s[0] != 1 or s[3] != 1:
            fail(f"{node['name']}: strides {s} move across batch or channels")
        return s[1:3]

    def conv(self, node: dict) -> None:
        self.check_common(node)
        fused = attr(node, "fused_ops", "strs", [])
        if fused not in (["BiasAdd"], ["BiasAdd", "Relu"]) or attr(node, "num_args", "i") != 1:
            fail(f"{node['name']}: fused ops {fused} are not supported")
        x = self.source(node)
        w, b = self.weight(node, 1), self.weight(node, 2)
        kh, kw, cin, cout = w.shape
        if self.shapes[x][0] != cin or b.shape != (cout,):
            fail(f"{node['name']}: weights {w.shape} and bias {b.shape} do not fit {self.shapes[x]}")
        strides = self.strides(node)
        (h, wd), pads = self.window(node, x, [kh, kw], strides)
        base = short(node["name"])
        wn = self.init(f"{base}/W", w.transpose(3, 2, 0, 1))
        bn = self.init(f"{base}/B", b)
        out = f"{base}/conv" if "Relu" in fused else base
        y = self.emit("Conv", [x, wn, bn], out, (cout, h, wd),
                      kernel_shape=[kh, kw], strides=strides, pads=pads)
        if "Relu" in fused:
            y = self.emit("Relu", [y], base, (cout, h, wd))
        self.values[node["name"]] = y

    def depthwise(self, node: dict) -> None:
        self.check_common(node)
        x = self.source(node)
        w = self.weight(node, 1)
        kh, kw, cin, mult = w.shape
        if self.shapes[x][0] != cin:
            fail(f"{node['name']}: weights {w.shape} do not fit {self.shapes[x]}")
        strides = self.strides(node)
        (h, wd), pads = self.window(node, x, [kh, kw], strides)
        base = short(node["name"])
        # [H,W,in,mult] -> [in,mult,H,W] -> [in*mult,1,H,W]: output g*mult+m.
        wn = self.init(f"{base}/W", w.transpose(2, 3, 0, 1).reshape(cin * mult, 1, kh, kw))
        self.values[node["name"]] = self.emit(
            "Conv", [x, wn], base, (cin * mult, h, wd), kernel_shape=[kh, kw],
            strides=strides, pads=pads, group=cin)

    def maxpool(self, node: dict) -> None:
        self.check_common(node)
        x = self.source(node)
        k = attr(node, "ksize", "ints")
        if k[0] != 1 or k[3] != 1:
            fail(f"{node['name']}: ksize {k} pools across batch or channels")
        strides = self.strides(node)
        (h, wd), pads = self.window(node, x, k[1:3], strides)
        # ONNX MaxPool ignores padded cells, as TF's SAME pooling does.
        self.values[node["name"]] = self.emit(
            "MaxPool", [x], short(node["name"]), (self.shapes[x][0], h, wd),
            kernel_shape=k[1:3], strides=strides, pads=pads)

    def add(self, node: dict) -> None:
        a, b = self.source(node, 0), self.source(node, 1)
        if self.shapes[a] != self.shapes[b]:
            fail(f"{node['name']}: shapes {self.shapes[a]} and {self.shapes[b]} differ")
        self.values[node["name"]] = self.emit("Add", [a, b], short(node["name"]), self.shapes[a])

    def relu(self, node: dict) -> None:
        x = self.source(node)
        self.values[node["name"]] = self.emit("Relu", [x], short(node["name"]), self.shapes[x])

    def mean(self, node: dict) -> None:
        x = self.source(node)
        axes = self.weight(node, 1).tolist()
        if sorted(axes) != [1, 2] or attr(node, "keep_dims", "b", False):
            fail(f"{node['name']}: only the mean over H and W without keep_dims is supported")
        base = short(node["name"])
        c = self.shapes[x][0]
        pooled = self.emit("GlobalAveragePool", [x], f"{base}/pool", (c, 1, 1))
        self.values[node["name"]] = self.emit("Flatten", [pooled], base, (c,), axis=1)


def convert(src_dir: str) -> onnx.ModelProto:
    with open(os.path.join(src_dir, "emotion.json")) as f:
        model = json.load(f)
    if model.get("format") != "graph-model":
        fail(f"expected a TF.js graph model, got format {model.get('format')!r}")
    b = Builder(read_weights(src_dir, model["weightsManifest"]))
    nodes = model["modelTopology"]["node"]
    consts = {n["name"] for n in nodes if n["op"] == "Const"}
    if consts != set(b.weights):
        fail(f"Const nodes and weights differ: {sorted(consts ^ set(b.weights))}")

    # Input: NHWC RGB, already normalised per channel -> NCHW -> gray.
    nchw = b.emit("Transpose", ["image"], "image/nchw", (3, SIZE, SIZE), perm=[0, 3, 1, 2])
    gray_w = np.array(GRAY, np.float32).reshape(1, 3, 1, 1)
    gray_b = np.array([gray_w.sum(dtype=np.float32) - np.float32(1)], np.float32)
    gray = b.emit("Conv", [nchw, b.init("gray/W", gray_w), b.init("gray/B", gray_b)], "gray",
                  (1, SIZE, SIZE), kernel_shape=[1, 1])

    handlers = {"_FusedConv2D": b.conv, "DepthwiseConv2dNative": b.depthwise,
                "MaxPool": b.maxpool, "AddV2": b.add, "Relu": b.relu, "Mean": b.mean}
    output = None
    for node in nodes:
        op = node["op"]
        if op == "Const":
            continue
        if op == "Placeholder":
            dims = [int(d.get("size", 0)) for d in node["attr"]["shape"]["shape"]["dim"]]
            if dims != [-1, SIZE, SIZE, 1] or node["attr"]["dtype"]["type"] != "DT_FLOAT":
                fail(f"input {node['name']} is {dims}, expected [-1,{SIZE},{SIZE},1] float")
            b.values[node["name"]] = gray
        elif op == "Softmax":
            x = b.source(node)
            if b.shapes[x] != (len(LABELS),):
                fail(f"{node['name']}: {b.shapes[x]} scores, expected {len(LABELS)}")
            b.values[node["name"]] = output = b.emit("Softmax", [x], "emotion", b.shapes[x], axis=1)
        elif op == "Identity":
            b.values[node["name"]] = b.source(node)
        elif op in handlers:
            handlers[op](node)
        else:
            fail(f"{node['name']}: op {op} is not supported")
    if output is None or b.values.get("Identity") != output:
        fail("the graph does not end in Softmax -> Identity")
    used = {i for n in b.nodes for i in n.input}
    unused = [t.name for t in b.inits if t.name not in used]
    if unused:
        fail(f"unused initializers {unused}")

    graph = helper.make_graph(
        b.nodes, "emotion",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", SIZE, SIZE, 3])],
        [helper.make_tensor_value_info("emotion", TensorProto.FLOAT, ["batch", len(LABELS)])],
        b.inits)
    out = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                            producer_name="tidegate models/emotion/convert.py",
                            ir_version=IR_VERSION)
    out.doc_string = (
        "Facial expression (FER2013 mini-XCEPTION, oarriaga/face_classification) from npm "
        "@vladmandic/human@3.3.6 models/emotion.json. Input: RGB NHWC, each channel "
        "(pixel/255 - 0.5)/0.5. Output: softmax over " + ", ".join(LABELS) + ".")
    onnx.checker.check_model(out, full_check=True)
    return out


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
        worst = max(worst, float(np.max(np.abs(got - singles[:n]))))
    if worst > 1e-5:
        fail(f"batch outputs differ from single runs by {worst}")
    return worst


def main() -> None:
    if len(sys.argv) != 3:
        fail("usage: convert.py SRC_DIR OUT.onnx")
    src_dir, out = sys.argv[1], sys.argv[2]
    model = convert(src_dir)
    onnx.save(model, out + ".tmp")
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        note = "onnxruntime not installed; batch check skipped"
    else:
        note = f"batch 2/8/32 outputs equal single runs (max |diff| {check_batches(out + '.tmp'):g})"
    os.replace(out + ".tmp", out)
    print(f"convert.py: wrote {out} ({len(model.graph.node)} nodes); {note}")


if __name__ == "__main__":
    main()
