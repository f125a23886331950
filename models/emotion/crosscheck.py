"""Checks models/emotion/model.onnx (convert.py's hand mapping) against two
independent references on the same inputs:
  - TensorFlow 2.15 running the TF.js graph itself (the JSON topology as a
    GraphDef, the Const nodes filled from emotion.bin);
  - tf2onnx 1.16.1's own conversion (--tfjs), run on ONNX Runtime.
The inputs are 32 random RGB images and crops of astronaut.png (the face
BlazeFace finds, enlarged 1.0/1.4/1.8 times, mirrored, and non-face
regions), preprocessed as human does for the references (gray =
0.2989 R + 0.5870 G + 0.1140 B of 0..1 values, then (gray - 0.5) * 2) and as
the worker does for model.onnx (each channel (pixel - 127.5) / 127.5).

A development check, not part of `make setup` or `make test`: it needs a
venv with TensorFlow and tf2onnx (models/tools/reference-requirements.txt;
crosscheck.sh creates it). Run from the repository root:
  models/emotion/crosscheck.sh
It prints the largest absolute difference of the 7 probabilities per pair,
and exits 1 above 1e-4.
"""

import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import tfjs_reference  # noqa: E402

LABELS = ["angry", "disgust", "fear", "happy", "sad", "surprise", "neutral"]
GRAY = np.array([0.2989, 0.5870, 0.1140], np.float32)
TOLERANCE = 1e-4
# BlazeFace's face in astronaut.png (cloud-worker/tests/blazeface.rs).
FACE = (177.3, 80.6, 271.8, 175.1)


def crops(png: str):
    """Names and 64x64 u8 RGB crops of astronaut.png (TensorFlow side)."""
    import tensorflow as tf

    img = tf.io.decode_png(tf.io.read_file(png), channels=3)
    h, w = int(img.shape[0]), int(img.shape[1])
    cx, cy = (FACE[0] + FACE[2]) / 2, (FACE[1] + FACE[3]) / 2
    side = max(FACE[2] - FACE[0], FACE[3] - FACE[1])
    boxes = {f"face x{s}": (cx - side * s / 2, cy - side * s / 2, cx + side * s / 2, cy + side * s / 2)
             for s in (1.0, 1.4, 1.8)}
    boxes.update({"suit": (150, 300, 350, 500), "flag": (380, 280, 512, 412),
                  "sky": (0, 0, 120, 120)})
    names, out = [], []
    for name, (x1, y1, x2, y2) in boxes.items():
        box = [[y1 / h, x1 / w, y2 / h, x2 / w]]
        crop = tf.image.crop_and_resize(tf.cast(img[None], tf.float32), box, [0], [64, 64])
        out.append(np.clip(np.round(crop.numpy()[0]), 0, 255).astype(np.uint8))
        names.append(name)
    names.append("face x1.4 mirrored")
    out.append(out[1][:, ::-1].copy())
    return names, np.stack(out)


def human_gray(rgb: np.ndarray) -> np.ndarray:
    """human's preprocessing: [N,64,64,3] u8 -> [N,64,64,1] f32."""
    gray = (rgb.astype(np.float32) / np.float32(255) * GRAY).sum(axis=3, keepdims=True)
    return (gray - np.float32(0.5)) * np.float32(2)


def tensorflow_side(src_dir: str, png: str, work: str) -> None:
    """Runs in the TensorFlow venv: inputs, TF outputs and tf2onnx's model."""
    session = tfjs_reference.load(src_dir, "emotion", work)
    rng = np.random.default_rng(11)
    random = rng.integers(0, 256, (32, 64, 64, 3), dtype=np.uint8)
    names, real = crops(png)
    names = [f"random {i}" for i in range(32)] + names
    rgb = np.concatenate([random, real])
    tf_out = session.run("Identity:0", {"input_1:0": human_gray(rgb)})
    np.savez(os.path.join(work, "tf.npz"), rgb=rgb, tf=tf_out, names=np.array(names))
    tfjs_reference.tf2onnx("emotion", work)


def compare(ours: str, work: str) -> None:
    """Runs in the model-tools venv (onnxruntime)."""
    import onnxruntime as ort

    ref = np.load(os.path.join(work, "tf.npz"))
    rgb, tf_out, names = ref["rgb"], ref["tf"], list(ref["names"])
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    a = ort.InferenceSession(ours, opts, providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(os.path.join(work, "tf2onnx.onnx"), opts,
                             providers=["CPUExecutionProvider"])
    worker = (rgb.astype(np.float32) - np.float32(127.5)) / np.float32(127.5)
    mine = a.run(None, {"image": worker})[0]
    singles = np.concatenate([a.run(None, {"image": worker[i:i + 1]})[0] for i in range(len(rgb))])
    theirs = b.run(None, {b.get_inputs()[0].name: human_gray(rgb)})[0]
    worst = 0.0
    for label, x, y in [("model.onnx vs TensorFlow", mine, tf_out),
                        ("model.onnx vs tf2onnx", mine, theirs),
                        ("tf2onnx vs TensorFlow", theirs, tf_out),
                        (f"model.onnx batch {len(rgb)} vs single runs", mine, singles)]:
        d = np.abs(x - y).max(axis=1)
        # np.maximum keeps a NaN (max() would drop it), and NaN fails below.
        worst = float(np.maximum(worst, d.max()))
        print(f"{label}: max |diff| {d.max():.3g} (random images {d[:32].max():.3g}, "
              f"astronaut crops {d[32:].max():.3g})")
    for i, name in enumerate(names):
        if name.startswith("random"):
            continue
        top = np.argsort(-mine[i])[:3]
        print(f"  {name:20s} " + ", ".join(f"{LABELS[k]} {mine[i][k]:.4f}" for k in top)
              + f"   (TensorFlow: {LABELS[int(np.argmax(tf_out[i]))]} {tf_out[i].max():.4f})")
    if not worst <= TOLERANCE:
        sys.exit(f"crosscheck.py: difference {worst:g} above {TOLERANCE:g}")


def main() -> None:
    mode = sys.argv[1]
    if mode == "--tensorflow":
        tensorflow_side(*sys.argv[2:5])
    elif mode == "--compare":
        compare(*sys.argv[2:4])
    else:
        tf_python, src_dir, png, ours = sys.argv[1:5]
        with tempfile.TemporaryDirectory() as work:
            subprocess.run([tf_python, __file__, "--tensorflow", src_dir, png, work], check=True)
            compare(ours, work)


if __name__ == "__main__":
    main()
