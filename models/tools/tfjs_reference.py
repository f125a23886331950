"""The TensorFlow side of the development cross-checks
(models/*/crosscheck.py): loads a TF.js graph model from human's tarball into
a TensorFlow session, and converts it with tf2onnx, as independent references
for models/tools/tfjs_onnx.py. Runs in the reference venv
(models/tools/reference.sh: tensorflow-cpu, tf2onnx, onnx); never used by
make setup or make test.
"""

import base64
import json
import os
import subprocess
import sys

from tfjs_onnx import read_weights


def patch(model: dict) -> None:
    """Adds the attributes the TF.js export leaves out and TensorFlow and
    tf2onnx need, set to TensorFlow's defaults: `TArgs` on fused
    convolutions, `index_type` on TopKV2."""
    for node in model["modelTopology"]["node"]:
        a = node.setdefault("attr", {})
        if node["op"] in ("_FusedConv2D", "FusedDepthwiseConv2dNative") and "TArgs" not in a:
            a["TArgs"] = {"list": {"type": ["DT_FLOAT"] * int(a["num_args"]["i"])}}
        if node["op"] == "TopKV2" and "index_type" not in a:
            a["index_type"] = {"type": "DT_INT32"}


def unfuse(nodes: list) -> list:
    """TF.js's FusedDepthwiseConv2dNative, which TensorFlow lacks, as the
    DepthwiseConv2dNative + BiasAdd (+ Relu | Relu6) it stands for."""
    out = []
    for node in nodes:
        if node["op"] != "FusedDepthwiseConv2dNative":
            out.append(node)
            continue
        a = node["attr"]
        ops = [base64.b64decode(s).decode() for s in a["fused_ops"]["list"]["s"]]
        assert ops[0] == "BiasAdd" and len(ops) <= 2 and int(a["num_args"]["i"]) == 1, ops
        name, (x, w, b) = node["name"], node["input"]
        keep = ("T", "strides", "padding", "dilations", "data_format", "explicit_paddings")
        out.append({"name": f"{name}/depthwise", "op": "DepthwiseConv2dNative", "input": [x, w],
                    "attr": {k: v for k, v in a.items() if k in keep}})
        biased = f"{name}/bias" if len(ops) == 2 else name
        out.append({"name": biased, "op": "BiasAdd", "input": [f"{name}/depthwise", b],
                    "attr": {"T": a["T"], "data_format": a["data_format"]}})
        if len(ops) == 2:
            out.append({"name": name, "op": ops[1], "input": [biased], "attr": {"T": a["T"]}})
    return out


def load(src_dir: str, name: str, work: str):
    """TensorFlow running `name`.json/.bin from `src_dir`; the patched TF.js
    files are left in work/tfjs for `tf2onnx`. Returns the session."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf
    from google.protobuf import json_format

    with open(os.path.join(src_dir, f"{name}.json")) as f:
        model = json.load(f)
    weights = read_weights(src_dir, model["weightsManifest"])
    patch(model)
    patched = os.path.join(work, "tfjs")
    os.makedirs(patched)
    with open(os.path.join(patched, f"{name}.json"), "w") as f:
        json.dump(model, f)
    with open(os.path.join(src_dir, f"{name}.bin"), "rb") as f, \
            open(os.path.join(patched, f"{name}.bin"), "wb") as g:
        g.write(f.read())

    graph_def = json_format.ParseDict({"node": unfuse(model["modelTopology"]["node"])},
                                      tf.compat.v1.GraphDef())
    for n in graph_def.node:
        if n.op == "Const":
            n.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(weights[n.name]))
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    return tf.compat.v1.Session(graph=graph)


def tf2onnx(name: str, work: str) -> None:
    """tf2onnx's conversion of work/tfjs/`name`.json to work/tf2onnx.onnx."""
    subprocess.run([sys.executable, "-m", "tf2onnx.convert", "--tfjs",
                    os.path.join(work, "tfjs", f"{name}.json"), "--output",
                    os.path.join(work, "tf2onnx.onnx"), "--opset", "13"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                   env=dict(os.environ, PYTHONHASHSEED="0"))
