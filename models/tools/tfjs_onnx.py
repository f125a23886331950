"""TF.js graph models to ONNX with onnx and numpy only: the ops human's
models use, each mapped by hand (models/emotion/convert.py and
models/centernet/convert.py drive it). Any other op, fused op, attribute
value or weight encoding stops the conversion with the node's name.

Weights: the manifest's shards are read in order; float32 weights stored as
float16 (TF.js "quantization": {"dtype": "float16"}) are widened to float32,
which is exact, as TF.js does when it loads them.

Layout: TensorFlow's tensors are NHWC. A 4-D value that convolutions
produce or consume is kept NCHW in ONNX (Value.nchw); an op that needs the
TensorFlow layout (Reshape, a slice, ...) gets a Transpose back, emitted
once per value. Element-wise ops keep NCHW when every non-constant operand
is NCHW, and their constants are transposed to match. TF Conv2D weights
[H,W,in,out] become [out,in,H,W]; depthwise weights [H,W,in,mult] become
[in*mult,1,H,W] (output channel g*mult+m, as in TF). SAME padding becomes
explicit pads from the static shapes (total = max((out-1)*stride + k - in,
0), the odd pixel at the end, as TF does), so nothing depends on a
runtime's auto_pad.

  Const                                   -> initializers where used
  _FusedConv2D, FusedDepthwiseConv2dNative
    (BiasAdd[, Relu | Relu6])             -> Conv (+ Relu | Clip 0..6)
  Conv2D, DepthwiseConv2dNative           -> Conv (group = channels)
  MaxPool                                 -> MaxPool (padding cells ignored, as TF)
  Mean over H, W                          -> GlobalAveragePool (+ Flatten without keep_dims)
  Add, AddV2, Sub, Mul, Equal             -> Add, Sub, Mul, Equal (broadcasting)
  FloorMod (integers)                     -> Mod (fmod 0: the sign of the divisor, as TF)
  FloorDiv (integers)                     -> (a - FloorMod(a, b)) / b, exact
  Relu, Relu6, Sigmoid, Cast              -> Relu, Clip 0..6, Sigmoid, Cast
  ConcatV2, Reshape, ExpandDims           -> Concat, Reshape, Unsqueeze
                                             (batch_dynamic: see below)
  StridedSlice (begin/end/shrink masks)   -> Slice (+ Squeeze)
  ResizeBilinear (no corner options)      -> Resize linear, asymmetric, whole-factor scales
  TopKV2 (sorted)                         -> TopK (ties: lower index first in both)
                                             + Cast of the indices to int32
  GatherV2 (batch_dims 0)                 -> Gather
  Identity                                -> the same value

Batch: a graph whose Placeholder has an unknown batch (emotion) maps as it
is. A graph frozen at batch 1 has that 1 folded into its constant shapes;
with `Converter(..., batch_dynamic=True)` the caller maps the input with an
unknown batch, and a Reshape of a [batch, ...] value to a constant shape
[1, ...] keeps the batch (ONNX's 0 copies it from the input), so the op
works on each image as it did on the one. Any other Reshape of a value with
an unknown batch stops the conversion: it mixes the batch with other
dimensions, and only the model's own converter knows what that meant.

Output bytes are reproducible: names come from the TF node names, initializers
and nodes are emitted in the graph's order, and opset and IR version are
fixed by the caller; nothing carries a timestamp.
"""

import base64
import json
import os
import sys
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

DTYPES = {"float32": np.float32, "int32": np.int32}
TF_DTYPES = {"DT_FLOAT": np.float32, "DT_INT32": np.int32, "DT_BOOL": np.bool_}
INT64_MAX = np.iinfo(np.int64).max
# NHWC axis -> NCHW axis.
TO_NCHW = [0, 2, 3, 1]


class ConversionError(Exception):
    """What in the TF.js graph the converter does not handle, and where."""


def fail(message: str):
    raise ConversionError(message)


def main_guard(tool: str, main) -> None:
    """Runs main(), printing a ConversionError as `tool: message`, exit 1."""
    try:
        main()
    except ConversionError as e:
        sys.exit(f"{tool}: {e}")


def convert_command(convert, check_batches) -> None:
    """The command line of a model's convert.py: `convert.py SRC_DIR OUT.onnx`.
    Converts SRC_DIR (the TF.js json + bin) with `convert`, writes OUT.onnx.tmp,
    runs `check_batches(path)` on it when onnxruntime is importable (it fails
    unless batch-N outputs equal N single runs, and returns the largest
    difference), then moves it into place."""

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
            worst = check_batches(out + ".tmp")
            note = f"batch 2/8/32 outputs equal single runs (max |diff| {worst:g})"
        os.replace(out + ".tmp", out)
        print(f"convert.py: wrote {out} ({len(model.graph.node)} nodes); {note}")

    main_guard("convert.py", main)


def read_weights(src_dir: str, manifest: list) -> dict:
    """Weights by name, read in manifest order from the concatenated shards."""
    weights = {}
    for group in manifest:
        data = b"".join(open(os.path.join(src_dir, p), "rb").read() for p in group["paths"])
        offset = 0
        for w in group["weights"]:
            if w["dtype"] not in DTYPES:
                fail(f"weight {w['name']}: unsupported dtype {w}")
            stored = DTYPES[w["dtype"]]
            if "quantization" in w:
                q = w["quantization"]
                if (q.get("dtype") != "float16" or w["dtype"] != "float32"
                        or set(q) - {"dtype", "original_dtype"}):
                    fail(f"weight {w['name']}: unsupported encoding {w}")
                stored = np.float16
            dtype = np.dtype(stored).newbyteorder("<")
            count = int(np.prod(w["shape"], dtype=np.int64))
            size = count * dtype.itemsize
            if offset + size > len(data):
                fail(f"weight {w['name']} runs past the end of {group['paths']}")
            array = np.frombuffer(data, dtype, count, offset).reshape(w["shape"])
            weights[w["name"]] = array.astype(np.dtype(DTYPES[w["dtype"]]))
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
        return bool(value.get("b", False))
    if kind == "i":
        return int(value.get("i", 0))
    if kind == "type":
        t = value.get("type", "DT_FLOAT")
        if t not in TF_DTYPES:
            fail(f"{node['name']}: {name} {t} is not supported")
        return TF_DTYPES[t]
    fail(f"unknown attribute kind {kind}")


@dataclass(frozen=True)
class Value:
    """An ONNX value with TensorFlow's view of it."""

    name: str
    # TensorFlow's shape (NHWC for images); None for an unknown dimension.
    shape: tuple
    dtype: type
    # A 4-D value stored NCHW in ONNX.
    nchw: bool = False


def broadcast(a: tuple, b: tuple) -> tuple:
    """NumPy broadcasting of two shapes; None is an unknown dimension."""
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x == 1:
            out.append(y)
        elif y == 1 or x == y:
            out.append(x)
        else:
            fail(f"shapes {a} and {b} do not broadcast")
    return tuple(out)


def window(node: dict, hw: tuple, k: list, strides: list):
    """Output [H, W] and ONNX pads for a kh x kw window over [H, W]."""
    padding = attr(node, "padding", "s")
    out, pads = [], [0, 0, 0, 0]
    for axis, (size, kk, s) in enumerate(zip(hw, k, strides)):
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


class Converter:
    """Walks a TF.js graph in order and emits the ONNX nodes for each op.

    Callers map the graph's Placeholder themselves (`values`), may handle
    other ops in `convert(extra)`, and then call `model()`.
    """

    def __init__(self, src_dir: str, stem: str, prefix: str = "", batch_dynamic: bool = False):
        with open(os.path.join(src_dir, f"{stem}.json")) as f:
            graph = json.load(f)
        if graph.get("format") != "graph-model":
            fail(f"expected a TF.js graph model, got format {graph.get('format')!r}")
        self.weights = read_weights(src_dir, graph["weightsManifest"])
        self.graph_nodes = graph["modelTopology"]["node"]
        consts = {n["name"] for n in self.graph_nodes if n["op"] == "Const"}
        if consts != set(self.weights):
            fail(f"Const nodes and weights differ: {sorted(consts ^ set(self.weights))}")
        self.prefix = prefix
        # The graph was frozen at batch 1: a leading 1 in a Reshape's constant
        # shape is the batch (see `reshape`).
        self.batch_dynamic = batch_dynamic
        self.nodes = []
        self.inits = []
        self.init_data = {}
        # TF output ("node" or "node:1") -> Value.
        self.values = {}
        # (ONNX name, nchw) -> the value transposed to that layout.
        self.layouts = {}

    # --- Emitting -----------------------------------------------------------

    def short(self, name: str) -> str:
        return name[len(self.prefix):] if self.prefix and name.startswith(self.prefix) else name

    def init(self, name: str, array: np.ndarray) -> str:
        array = np.ascontiguousarray(array)
        if name in self.init_data:
            old = self.init_data[name]
            if old.dtype != array.dtype or old.shape != array.shape or not np.array_equal(old, array):
                fail(f"initializer {name} is defined twice with different contents")
            return name
        self.init_data[name] = array
        self.inits.append(numpy_helper.from_array(array, name))
        return name

    def emit(self, op: str, inputs: list, output: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, [output], name=output, **attrs))
        return output

    def put(self, node: dict, name: str, shape, dtype, nchw: bool, index: int = 0) -> Value:
        v = Value(name, tuple(shape), dtype, nchw)
        self.values[node["name"] if index == 0 else f"{node['name']}:{index}"] = v
        return v

    # --- Reading a node's inputs ------------------------------------------------

    def ref(self, node: dict, index: int) -> str:
        inputs = node.get("input", [])
        if index >= len(inputs):
            fail(f"{node['name']}: expected at least {index + 1} inputs")
        name = inputs[index]
        if name.startswith("^"):
            fail(f"{node['name']}: control inputs are not supported")
        return name[:-2] if name.endswith(":0") else name

    def is_const(self, node: dict, index: int) -> bool:
        return self.ref(node, index) in self.weights

    def const(self, node: dict, index: int) -> np.ndarray:
        name = self.ref(node, index)
        if name not in self.weights:
            fail(f"{node['name']}: input {name} is not a constant")
        return self.weights[name]

    def value(self, node: dict, index: int = 0) -> Value:
        name = self.ref(node, index)
        if name not in self.values:
            fail(f"{node['name']}: input {name} is not computed before it")
        return self.values[name]

    def nchw(self, v: Value) -> Value:
        if v.nchw:
            return v
        if len(v.shape) != 4:
            fail(f"{v.name}: {v.shape} is not an image tensor")
        key = (v.name, True)
        if key not in self.layouts:
            name = self.emit("Transpose", [v.name], f"{v.name}/nchw", perm=[0, 3, 1, 2])
            self.layouts[key] = Value(name, v.shape, v.dtype, True)
        return self.layouts[key]

    def plain(self, v: Value) -> Value:
        if not v.nchw:
            return v
        key = (v.name, False)
        if key not in self.layouts:
            name = self.emit("Transpose", [v.name], f"{v.name}/nhwc", perm=[0, 2, 3, 1])
            self.layouts[key] = Value(name, v.shape, v.dtype, False)
        return self.layouts[key]

    # --- Walking the graph --------------------------------------------------------

    def convert(self, extra: dict = None) -> None:
        """Maps every node but Const and Placeholder (set in `values` by the
        caller) in the graph's order; `extra` maps op names to handlers that
        replace or add to the built-in ones."""
        handlers = {
            "_FusedConv2D": self.conv, "Conv2D": self.conv,
            "FusedDepthwiseConv2dNative": self.depthwise,
            "DepthwiseConv2dNative": self.depthwise,
            "MaxPool": self.maxpool, "Mean": self.mean,
            "Add": self.binary, "AddV2": self.binary, "Sub": self.binary,
            "Mul": self.binary, "Equal": self.binary,
            "FloorMod": self.floormod, "FloorDiv": self.floordiv,
            "Relu": self.unary, "Sigmoid": self.unary, "Relu6": self.relu6,
            "Cast": self.cast, "Identity": self.identity,
            "ConcatV2": self.concat, "Reshape": self.reshape,
            "ExpandDims": self.expand_dims, "StridedSlice": self.strided_slice,
            "ResizeBilinear": self.resize_bilinear, "TopKV2": self.topk,
            "GatherV2": self.gather,
        }
        handlers.update(extra or {})
        for node in self.graph_nodes:
            op = node["op"]
            if op == "Const":
                continue
            if op == "Placeholder":
                if node["name"] not in self.values:
                    fail(f"input {node['name']} is not mapped")
                continue
            if op not in handlers:
                fail(f"{node['name']}: op {op} is not supported")
            handlers[op](node)

    def model(self, name: str, inputs: list, outputs: list, opset: int, ir_version: int,
              producer: str, doc: str) -> onnx.ModelProto:
        """The ONNX model, checked with onnx.checker (full shape inference)."""
        used = {i for n in self.nodes for i in n.input}
        unused = [t.name for t in self.inits if t.name not in used]
        if unused:
            fail(f"unused initializers {unused}")
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        out = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                                producer_name=producer, ir_version=ir_version)
        out.doc_string = doc
        onnx.checker.check_model(out, full_check=True)
        return out

    # --- Convolutions and pooling -------------------------------------------

    def check_window(self, node: dict) -> list:
        """Checks data_format, dilations and explicit paddings; the strides."""
        if attr(node, "data_format", "s", "NHWC") != "NHWC":
            fail(f"{node['name']}: data_format must be NHWC")
        if any(d != 1 for d in attr(node, "dilations", "ints", [1, 1, 1, 1])):
            fail(f"{node['name']}: dilations are not supported")
        if attr(node, "explicit_paddings", "ints", []):
            fail(f"{node['name']}: explicit_paddings are not supported")
        s = attr(node, "strides", "ints", [1, 1, 1, 1])
        if s[0] != 1 or s[3] != 1:
            fail(f"{node['name']}: strides {s} move across batch or channels")
        return s[1:3]

    def fused(self, node: dict) -> tuple:
        """(has bias, activation or None) of a conv, fused or not."""
        if not node["op"].startswith("Fused") and not node["op"].startswith("_Fused"):
            return False, None
        ops = attr(node, "fused_ops", "strs", [])
        if ops not in (["BiasAdd"], ["BiasAdd", "Relu"], ["BiasAdd", "Relu6"]) \
                or attr(node, "num_args", "i") != 1:
            fail(f"{node['name']}: fused ops {ops} are not supported")
        return True, (ops[1] if len(ops) > 1 else None)

    def activate(self, base: str, y: str, act) -> str:
        if act == "Relu":
            return self.emit("Relu", [y], base)
        if act == "Relu6":
            return self.emit("Clip", [y, self.init("Relu6/min", np.float32(0)),
                                      self.init("Relu6/max", np.float32(6))], base)
        return y

    def conv(self, node: dict) -> None:
        strides = self.check_window(node)
        bias, act = self.fused(node)
        x = self.nchw(self.value(node))
        w = self.const(node, 1)
        kh, kw, cin, cout = w.shape
        n, h, wd, c = x.shape
        if c != cin:
            fail(f"{node['name']}: weights {w.shape} do not fit {x.shape}")
        (oh, ow), pads = window(node, (h, wd), [kh, kw], strides)
        base = self.short(node["name"])
        inputs = [x.name, self.init(f"{base}/W", w.transpose(3, 2, 0, 1))]
        if bias:
            b = self.const(node, 2)
            if b.shape != (cout,):
                fail(f"{node['name']}: bias {b.shape} does not fit weights {w.shape}")
            inputs.append(self.init(f"{base}/B", b))
        y = self.emit("Conv", inputs, f"{base}/conv" if act else base,
                      kernel_shape=[kh, kw], strides=strides, pads=pads)
        self.put(node, self.activate(base, y, act), (n, oh, ow, cout), np.float32, True)

    def depthwise(self, node: dict) -> None:
        strides = self.check_window(node)
        bias, act = self.fused(node)
        x = self.nchw(self.value(node))
        w = self.const(node, 1)
        kh, kw, cin, mult = w.shape
        n, h, wd, c = x.shape
        if c != cin:
            fail(f"{node['name']}: weights {w.shape} do not fit {x.shape}")
        (oh, ow), pads = window(node, (h, wd), [kh, kw], strides)
        base = self.short(node["name"])
        # [H,W,in,mult] -> [in,mult,H,W] -> [in*mult,1,H,W]: output g*mult+m.
        inputs = [x.name, self.init(f"{base}/W",
                                    w.transpose(2, 3, 0, 1).reshape(cin * mult, 1, kh, kw))]
        if bias:
            b = self.const(node, 2)
            if b.shape != (cin * mult,):
                fail(f"{node['name']}: bias {b.shape} does not fit weights {w.shape}")
            inputs.append(self.init(f"{base}/B", b))
        y = self.emit("Conv", inputs, f"{base}/conv" if act else base, kernel_shape=[kh, kw],
                      strides=strides, pads=pads, group=cin)
        self.put(node, self.activate(base, y, act), (n, oh, ow, cin * mult), np.float32, True)

    def maxpool(self, node: dict) -> None:
        strides = self.check_window(node)
        x = self.nchw(self.value(node))
        k = attr(node, "ksize", "ints")
        if k[0] != 1 or k[3] != 1:
            fail(f"{node['name']}: ksize {k} pools across batch or channels")
        n, h, wd, c = x.shape
        (oh, ow), pads = window(node, (h, wd), k[1:3], strides)
        # ONNX MaxPool ignores padded cells, as TF's SAME pooling does.
        name = self.emit("MaxPool", [x.name], self.short(node["name"]),
                         kernel_shape=k[1:3], strides=strides, pads=pads)
        self.put(node, name, (n, oh, ow, c), x.dtype, True)

    def mean(self, node: dict) -> None:
        x = self.value(node)
        axes = sorted(int(a) % 4 for a in np.ravel(self.const(node, 1)))
        if len(x.shape) != 4 or axes != [1, 2] or x.dtype != np.float32:
            fail(f"{node['name']}: only the mean of an image over H and W is supported")
        x = self.nchw(x)
        base = self.short(node["name"])
        n, _, _, c = x.shape
        if attr(node, "keep_dims", "b", False):
            self.put(node, self.emit("GlobalAveragePool", [x.name], base), (n, 1, 1, c),
                     x.dtype, True)
        else:
            pooled = self.emit("GlobalAveragePool", [x.name], f"{base}/pool")
            self.put(node, self.emit("Flatten", [pooled], base, axis=1), (n, c), x.dtype, False)

    # --- Element-wise -------------------------------------------------------

    def operands(self, node: dict, count: int) -> tuple:
        """ONNX names, TF shapes and dtype of `count` operands, and whether the
        result is NCHW: when every non-constant operand is NCHW, constants
        are transposed to match; otherwise everything is TF's layout."""
        base = self.short(node["name"])
        values = [None if self.is_const(node, i) else self.value(node, i) for i in range(count)]
        live = [v for v in values if v is not None]
        if not live:
            fail(f"{node['name']}: constant folding is not supported")
        nchw = all(v.nchw for v in live)
        names, shapes, dtypes = [], [], set()
        for i in range(count):
            if values[i] is not None:
                v = values[i] if nchw else self.plain(values[i])
                names.append(v.name)
                shapes.append(v.shape)
                dtypes.add(np.dtype(v.dtype))
                continue
            c = self.const(node, i)
            shapes.append(c.shape)
            dtypes.add(c.dtype)
            cname = self.short(self.ref(node, i))
            if nchw and c.ndim > 0:
                if c.ndim > 4:
                    fail(f"{node['name']}: constant {c.shape} does not fit an image")
                c = c.reshape((1,) * (4 - c.ndim) + c.shape).transpose(0, 3, 1, 2)
                cname = f"{cname}/nchw"
            names.append(self.init(cname, c))
        if len(dtypes) != 1:
            fail(f"{node['name']}: operands of types {sorted(map(str, dtypes))}")
        shape = shapes[0]
        for s in shapes[1:]:
            shape = broadcast(tuple(shape), tuple(s))
        return base, names, tuple(shape), dtypes.pop().type, nchw

    def binary(self, node: dict) -> None:
        op = {"Add": "Add", "AddV2": "Add", "Sub": "Sub", "Mul": "Mul", "Equal": "Equal"}[node["op"]]
        if node["op"] == "Equal" and not attr(node, "incompatible_shape_error", "b", True):
            fail(f"{node['name']}: incompatible_shape_error false is not supported")
        base, names, shape, dtype, nchw = self.operands(node, 2)
        out = np.bool_ if op == "Equal" else dtype
        self.put(node, self.emit(op, names, base), shape, out, nchw)

    def integer_operands(self, node: dict):
        base, names, shape, dtype, nchw = self.operands(node, 2)
        if not np.issubdtype(dtype, np.integer):
            fail(f"{node['name']}: {node['op']} of {np.dtype(dtype)} is not supported")
        return base, names, shape, dtype, nchw

    def floormod(self, node: dict) -> None:
        base, names, shape, dtype, nchw = self.integer_operands(node)
        # ONNX integer Mod with fmod 0 takes the sign of the divisor: floor mod.
        self.put(node, self.emit("Mod", names, base, fmod=0), shape, dtype, nchw)

    def floordiv(self, node: dict) -> None:
        base, (a, b), shape, dtype, nchw = self.integer_operands(node)
        # a - floormod(a, b) is a multiple of b, so ONNX's truncating Div is exact.
        mod = self.emit("Mod", [a, b], f"{base}/mod", fmod=0)
        diff = self.emit("Sub", [a, mod], f"{base}/sub")
        self.put(node, self.emit("Div", [diff, b], base), shape, dtype, nchw)

    def unary(self, node: dict) -> None:
        x = self.value(node)
        self.put(node, self.emit(node["op"], [x.name], self.short(node["name"])), x.shape,
                 x.dtype, x.nchw)

    def relu6(self, node: dict) -> None:
        x = self.value(node)
        if x.dtype != np.float32:
            fail(f"{node['name']}: Relu6 of {np.dtype(x.dtype)} is not supported")
        name = self.activate(self.short(node["name"]), x.name, "Relu6")
        self.put(node, name, x.shape, x.dtype, x.nchw)

    def cast(self, node: dict) -> None:
        x = self.value(node)
        src, dst = attr(node, "SrcT", "type"), attr(node, "DstT", "type")
        if np.dtype(src) != np.dtype(x.dtype) or attr(node, "Truncate", "b", False):
            fail(f"{node['name']}: Cast from {np.dtype(src)} of a {np.dtype(x.dtype)} value")
        to = helper.np_dtype_to_tensor_dtype(np.dtype(dst))
        self.put(node, self.emit("Cast", [x.name], self.short(node["name"]), to=to), x.shape,
                 dst, x.nchw)

    def identity(self, node: dict) -> None:
        self.values[node["name"]] = self.value(node)

    # --- Shapes, slices, gathers ------------------------------------------------

    def concat(self, node: dict) -> None:
        count = attr(node, "N", "i")
        if len(node["input"]) != count + 1:
            fail(f"{node['name']}: {len(node['input'])} inputs for N = {count}")
        values = [self.value(node, i) for i in range(count)]
        rank = len(values[0].shape)
        axis = int(self.const(node, count)) % rank
        nchw = rank == 4 and all(v.nchw for v in values)
        if not nchw:
            values = [self.plain(v) for v in values]
        shape = list(values[0].shape)
        for v in values[1:]:
            if len(v.shape) != rank or v.dtype != values[0].dtype or any(
                    a != b for i, (a, b) in enumerate(zip(v.shape, shape)) if i != axis):
                fail(f"{node['name']}: cannot concatenate {[u.shape for u in values]}")
            shape[axis] = None if shape[axis] is None or v.shape[axis] is None \
                else shape[axis] + v.shape[axis]
        name = self.emit("Concat", [v.name for v in values], self.short(node["name"]),
                         axis=TO_NCHW[axis] if nchw else axis)
        self.put(node, name, shape, values[0].dtype, nchw)

    def reshape(self, node: dict) -> None:
        x = self.plain(self.value(node))
        target = [int(d) for d in np.ravel(self.const(node, 1))]
        if 0 in target or target.count(-1) > 1 or any(d < -1 for d in target):
            fail(f"{node['name']}: shape {target} is not supported")
        dims, rest, batch = x.shape, target, []
        if self.batch_dynamic and x.shape[:1] == (None,):
            if target[:1] != [1]:
                fail(f"{node['name']}: reshaping {x.shape} to {target} mixes the batch with "
                     "other dimensions; map this op in the model's converter")
            # The batch the graph was frozen at: 0 copies the input's batch.
            dims, rest, batch = x.shape[1:], target[1:], [None]
            target = [0] + rest
        if None in dims:
            fail(f"{node['name']}: Reshape of {x.shape} needs a static shape")
        size = int(np.prod(dims, dtype=np.int64))
        known = int(np.prod([d for d in rest if d != -1], dtype=np.int64))
        shape = batch + [size // known if d == -1 else d for d in rest]
        if int(np.prod(shape[len(batch):], dtype=np.int64)) != size:
            fail(f"{node['name']}: cannot reshape {x.shape} to {target}")
        base = self.short(node["name"])
        shape_init = self.init(f"{base}/shape", np.array(target, np.int64))
        self.put(node, self.emit("Reshape", [x.name, shape_init], base), shape, x.dtype, False)

    def expand_dims(self, node: dict) -> None:
        x = self.plain(self.value(node))
        dim = int(self.const(node, 1))
        rank = len(x.shape)
        if not -rank - 1 <= dim <= rank:
            fail(f"{node['name']}: dim {dim} is out of range for {x.shape}")
        dim = dim + rank + 1 if dim < 0 else dim
        base = self.short(node["name"])
        axes = self.init(f"{base}/axes", np.array([dim], np.int64))
        shape = x.shape[:dim] + (1,) + x.shape[dim:]
        self.put(node, self.emit("Unsqueeze", [x.name, axes], base), shape, x.dtype, False)

    def strided_slice(self, node: dict) -> None:
        x = self.plain(self.value(node))
        begin, end, strides = (np.ravel(self.const(node, i)).astype(np.int64) for i in (1, 2, 3))
        if attr(node, "ellipsis_mask", "i") or attr(node, "new_axis_mask", "i"):
            fail(f"{node['name']}: ellipsis and new-axis masks are not supported")
        if not len(begin) == len(end) == len(strides) <= len(x.shape) or np.any(strides < 1):
            fail(f"{node['name']}: slice {begin}:{end}:{strides} of {x.shape} is not supported")
        begin_mask, end_mask = attr(node, "begin_mask", "i"), attr(node, "end_mask", "i")
        shrink = attr(node, "shrink_axis_mask", "i")
        starts, ends, shape, squeeze = [], [], list(x.shape), []
        for i, (b, e, s) in enumerate(zip(begin, end, strides)):
            b = 0 if begin_mask >> i & 1 else int(b)
            e = INT64_MAX if end_mask >> i & 1 else int(e)
            if shrink >> i & 1:
                if s != 1:
                    fail(f"{node['name']}: a shrunk axis with stride {s}")
                e = INT64_MAX if b == -1 else b + 1
                squeeze.append(i)
            starts.append(b)
            ends.append(e)
            if shape[i] is not None:
                shape[i] = len(range(*slice(b, None if e == INT64_MAX else e, int(s))
                                     .indices(shape[i])))
            elif (b, e, s) != (0, INT64_MAX, 1):
                fail(f"{node['name']}: slicing the unknown dimension {i} of {x.shape}")
            if squeeze and squeeze[-1] == i and shape[i] != 1:
                fail(f"{node['name']}: shrinking axis {i} that has no element {b}")
        base = self.short(node["name"])
        axes = list(range(len(starts)))
        inputs = [x.name, self.init(f"{base}/starts", np.array(starts, np.int64)),
                  self.init(f"{base}/ends", np.array(ends, np.int64)),
                  self.init(f"{base}/axes", np.array(axes, np.int64)),
                  self.init(f"{base}/steps", strides.astype(np.int64))]
        if squeeze:
            y = self.emit("Slice", inputs, f"{base}/slice")
            y = self.emit("Squeeze", [y, self.init(f"{base}/squeeze", np.array(squeeze, np.int64))],
                          base)
            shape = [d for i, d in enumerate(shape) if i not in squeeze]
        else:
            y = self.emit("Slice", inputs, base)
        self.put(node, y, shape, x.dtype, False)

    def resize_bilinear(self, node: dict) -> None:
        if attr(node, "align_corners", "b", False) or attr(node, "half_pixel_centers", "b", False):
            fail(f"{node['name']}: only align_corners = half_pixel_centers = false is supported")
        x = self.nchw(self.value(node))
        size = [int(d) for d in np.ravel(self.const(node, 1))]
        n, h, w, c = x.shape
        if len(size) != 2 or size[0] % h or size[1] % w:
            fail(f"{node['name']}: resizing {x.shape} to {size} is not by whole factors")
        # TF's legacy scaler reads output pixel o at o * in/out; ONNX's
        # asymmetric mode at o / (out/in): the same for whole factors, where
        # both are exact. Both clamp the last neighbour to the edge.
        scales = np.array([1, 1, size[0] // h, size[1] // w], np.float32)
        base = self.short(node["name"])
        name = self.emit("Resize", [x.name, "", self.init(f"{base}/scales", scales)], base,
                         mode="linear", coordinate_transformation_mode="asymmetric")
        self.put(node, name, (n, size[0], size[1], c), x.dtype, True)

    def topk(self, node: dict) -> None:
        x = self.plain(self.value(node))
        k = int(self.const(node, 1))
        if not attr(node, "sorted", "b", True):
            fail(f"{node['name']}: unsorted TopKV2 is not supported")
        index = attr(node, "index_type", "type", np.int32)
        if x.shape[-1] is None or not 0 < k <= x.shape[-1]:
            fail(f"{node['name']}: top {k} of {x.shape}")
        base = self.short(node["name"])
        shape = x.shape[:-1] + (k,)
        kname = self.init(f"{base}/k", np.array([k], np.int64))
        # Ties: TF and ONNX (opset 11 and later) both put the lower index first.
        self.nodes.append(helper.make_node("TopK", [x.name, kname], [base, f"{base}/indices64"],
                                           name=base, axis=-1, largest=1, sorted=1))
        self.put(node, base, shape, x.dtype, False)
        indices = f"{base}/indices64"
        if np.dtype(index) != np.int64:
            indices = self.emit("Cast", [indices], f"{base}/indices",
                                to=helper.np_dtype_to_tensor_dtype(np.dtype(index)))
        self.put(node, indices, shape, index, False, index=1)

    def gather(self, node: dict) -> None:
        params, indices = self.plain(self.value(node, 0)), self.plain(self.value(node, 1))
        axis = int(self.const(node, 2)) % len(params.shape)
        if attr(node, "batch_dims", "i", 0) != 0:
            fail(f"{node['name']}: batch_dims is not supported")
        if not np.issubdtype(indices.dtype, np.integer):
            fail(f"{node['name']}: indices of {np.dtype(indices.dtype)}")
        shape = params.shape[:axis] + indices.shape + params.shape[axis + 1:]
        name = self.emit("Gather", [params.name, indices.name], self.short(node["name"]),
                         axis=axis)
        self.put(node, name, shape, params.dtype, False)
