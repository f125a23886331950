"""Converts MB3-CenterNet from the TF.js graph model in npm
@vladmandic/human@3.3.6 (models/centernet.json + centernet.bin) to ONNX.

tf2onnx 1.16.1 reads TF.js graph models (--tfjs) but stumbles on two
attributes this export leaves out, which are added first (both are what
TensorFlow's defaults would be):
  - `TArgs` on _FusedConv2D / FusedDepthwiseConv2dNative: one DT_FLOAT per
    fused argument (`num_args`);
  - `index_type` on TopKV2: DT_INT32.
Then the graph is checked: input [1,512,512,3] f32 (RGB 0..255), output
`tower_0/detections` [1,100,6] (x1,y1,x2,y2 in input pixels, score, class).

The converted bytes are not reproducible: tf2onnx's optimiser and constant
de-duplication iterate in an order that changes between runs (even with
PYTHONHASHSEED fixed), so equivalent graphs with differently arranged
constants come out. The model is therefore checked by what it computes
(cloud-worker/tests/centernet.rs), not by a pinned sha256.

Usage: convert.py SRC_DIR OUT.onnx   (SRC_DIR holds centernet.json/.bin)
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import onnx


def patch(src_dir: str, work: str) -> None:
    with open(os.path.join(src_dir, "centernet.json")) as f:
        model = json.load(f)
    patched = 0
    for node in model["modelTopology"]["node"]:
        attr = node.setdefault("attr", {})
        if node["op"] in ("_FusedConv2D", "FusedDepthwiseConv2dNative") and "TArgs" not in attr:
            args = int(attr.get("num_args", {}).get("i", "0"))
            attr["TArgs"] = {"list": {"type": ["DT_FLOAT"] * args}}
            patched += 1
        if node["op"] == "TopKV2" and "index_type" not in attr:
            attr["index_type"] = {"type": "DT_INT32"}
            patched += 1
    with open(os.path.join(work, "centernet.json"), "w") as f:
        json.dump(model, f)
    shutil.copy(os.path.join(src_dir, "centernet.bin"), work)
    print(f"convert.py: added {patched} missing attributes")


def check(path: str) -> None:
    m = onnx.load(path)
    onnx.checker.check_model(m)
    dims = lambda vi: [d.dim_value or d.dim_param for d in vi.type.tensor_type.shape.dim]
    inputs = {i.name: dims(i) for i in m.graph.input}
    outputs = {o.name: dims(o) for o in m.graph.output}
    assert inputs == {"tower_0/images:0": [1, 512, 512, 3]}, inputs
    assert outputs.get("tower_0/detections") == [1, 100, 6], outputs


def main() -> None:
    src_dir, out = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory() as work:
        patch(src_dir, work)
        env = dict(os.environ, PYTHONHASHSEED="0", TF_CPP_MIN_LOG_LEVEL="2")
        subprocess.run(
            [sys.executable, "-m", "tf2onnx.convert", "--tfjs", os.path.join(work, "centernet.json"),
             "--output", out + ".tmp", "--opset", "13"],
            check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    check(out + ".tmp")
    os.replace(out + ".tmp", out)
    print(f"convert.py: wrote {out}")


if __name__ == "__main__":
    main()
