"""Checks models/centernet/model.onnx (convert.py's hand mapping) against two
independent references on the same inputs:
  - TensorFlow 2.15 running the TF.js graph itself (the JSON topology as a
    GraphDef, the Const nodes filled from centernet.bin, float16 weights
    widened to float32 by this script's own reader);
  - tf2onnx 1.16.1's own conversion (--tfjs), run on ONNX Runtime.
The inputs are astronaut.png (512x512 already), the four vtest.avi frames
of models/testdata/vtest letterboxed into 512x512 as the edge does (when
present), and 8 random images; pixels are whole numbers 0..255 as f32, as
the worker feeds them.

A development check, not part of `make setup` or `make test`: it needs a
venv with TensorFlow and tf2onnx (models/tools/reference-requirements.txt;
crosscheck.sh creates it). Run from the repository root:
  models/centernet/crosscheck.sh
For each pair it prints, over the 100 rows of every image, the largest
absolute difference of the boxes (input pixels) and of the scores, and how
many rows differ in class; then the detections scoring 0.3 or more (the
decoder's threshold). It exits 1 when a class differs or a box or score
differs by more than the tolerances below. model.onnx also runs all the
images as one batch, which must give the rows of its single runs (classes
equal, values within 1e-5; it says whether they are equal bit for bit).
"""

import os
import subprocess
import sys
import tempfile
import tomllib

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import tfjs_reference  # noqa: E402

SIZE = 512
BOX_TOLERANCE = 0.01  # input pixels
SCORE_TOLERANCE = 1e-4
SHOW = 0.3


def images(png: str, vtest_dir: str):
    """Names and [N,512,512,3] f32 images of whole numbers (TensorFlow side)."""
    import tensorflow as tf

    names, out = [], []
    astro = tf.io.decode_png(tf.io.read_file(png), channels=3).numpy()
    if astro.shape != (SIZE, SIZE, 3):
        sys.exit(f"crosscheck.py: {png} is {astro.shape}, expected {(SIZE, SIZE, 3)}")
    names.append("astronaut.png")
    out.append(astro.astype(np.float32))
    for s in ("00", "20", "40", "60"):
        path = os.path.join(vtest_dir, f"frame-{s}.png")
        if not os.path.isfile(path):
            continue
        frame = tf.io.decode_png(tf.io.read_file(path), channels=3)
        h, w = int(frame.shape[0]), int(frame.shape[1])
        cw, ch = (SIZE, (h * SIZE + w // 2) // w) if w >= h else ((w * SIZE + h // 2) // h, SIZE)
        content = tf.image.resize(tf.cast(frame, tf.float32), [ch, cw], antialias=True).numpy()
        canvas = np.zeros((SIZE, SIZE, 3), np.float32)
        y, x = (SIZE - ch) // 2, (SIZE - cw) // 2
        canvas[y:y + ch, x:x + cw] = np.clip(np.round(content), 0, 255)
        names.append(f"vtest {s} s")
        out.append(canvas)
    rng = np.random.default_rng(5)
    for i in range(8):
        names.append(f"random {i}")
        out.append(rng.integers(0, 256, (SIZE, SIZE, 3)).astype(np.float32))
    return names, np.stack(out)


def tensorflow_side(src_dir: str, png: str, vtest_dir: str, work: str) -> None:
    """Runs in the TensorFlow venv: inputs, TF outputs and tf2onnx's model."""
    session = tfjs_reference.load(src_dir, "centernet", work)
    names, batch = images(png, vtest_dir)
    tf_out = np.concatenate([session.run("tower_0/detections:0", {"tower_0/images:0": x[None]})
                             for x in batch])
    np.savez(os.path.join(work, "tf.npz"), images=batch, tf=tf_out, names=np.array(names))
    tfjs_reference.tf2onnx("centernet", work)


def run_onnx(path: str, batch: np.ndarray, output: str = None,
             together: bool = False) -> np.ndarray:
    """One run per image, or with `together` one run of the whole batch."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    s = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    name = s.get_inputs()[0].name
    if together:
        return s.run([output] if output else None, {name: batch})[0]
    out = [s.run([output] if output else None, {name: x[None]})[0] for x in batch]
    return np.concatenate(out)


def compare(ours: str, work: str) -> None:
    """Runs in the model-tools venv (onnxruntime)."""
    with open(os.path.join(os.path.dirname(ours), "model.toml"), "rb") as f:
        labels = tomllib.load(f)["decoder"]["labels"]
    ref = np.load(os.path.join(work, "tf.npz"))
    batch, tf_out, names = ref["images"], ref["tf"], list(ref["names"])
    mine = run_onnx(ours, batch)
    theirs = run_onnx(os.path.join(work, "tf2onnx.onnx"), batch, "tower_0/detections")
    groups = {g: [i for i, n in enumerate(names) if n.startswith(g)]
              for g in ("astronaut", "vtest", "random")}
    bad = []
    for label, x, y in [("model.onnx vs TensorFlow", mine, tf_out),
                        ("model.onnx vs tf2onnx", mine, theirs),
                        ("tf2onnx vs TensorFlow", theirs, tf_out)]:
        box = np.abs(x[:, :, :4] - y[:, :, :4]).max(axis=(1, 2))
        score = np.abs(x[:, :, 4] - y[:, :, 4]).max(axis=1)
        classes = np.sum(x[:, :, 5] != y[:, :, 5], axis=1)
        print(f"{label}: max |diff| boxes {box.max():.2g} px, scores {score.max():.2g}; "
              f"classes differ in {classes.sum()} of {classes.size * 100} rows")
        for g, idx in groups.items():
            if idx:
                print(f"  {g:9s} ({len(idx)}): boxes {box[idx].max():.2g} px, "
                      f"scores {score[idx].max():.2g}, classes differ in {classes[idx].sum()} rows")
        # `not <=`: a NaN difference fails (it compares false with `>`).
        if classes.sum() or not box.max() <= BOX_TOLERANCE \
                or not score.max() <= SCORE_TOLERANCE:
            bad.append(label)
    together = run_onnx(ours, batch, together=True)
    same = np.array_equal(together.view(np.uint32), mine.view(np.uint32))
    worst = float(np.abs(together - mine).max())
    print(f"model.onnx, one batch of {len(batch)} vs single runs: max |diff| {worst:.2g}, "
          f"classes differ in {int(np.sum(together[:, :, 5] != mine[:, :, 5]))} rows, "
          f"{'equal' if same else 'not equal'} bit for bit")
    if not np.array_equal(together[:, :, 5], mine[:, :, 5]) or not worst <= 1e-5:
        bad.append("model.onnx batch vs single runs")
    for i, name in enumerate(names):
        rows = [r for r in mine[i] if r[4] >= SHOW]
        print(f"{name}: {len(rows)} detections scoring {SHOW} or more"
              f" (TensorFlow: {int(np.sum(tf_out[i, :, 4] >= SHOW))})")
        for r in rows:
            print(f"  {labels[int(r[5])]:12s} {r[4]:.4f} "
                  f"({r[0]:.1f}, {r[1]:.1f}) - ({r[2]:.1f}, {r[3]:.1f})")
    if bad:
        sys.exit("crosscheck.py: above the tolerances: " + "; ".join(bad))


def main() -> None:
    mode = sys.argv[1]
    if mode == "--tensorflow":
        tensorflow_side(*sys.argv[2:6])
    elif mode == "--compare":
        compare(*sys.argv[2:4])
    else:
        tf_python, src_dir, png, vtest_dir, ours = sys.argv[1:6]
        with tempfile.TemporaryDirectory() as work:
            subprocess.run([tf_python, __file__, "--tensorflow", src_dir, png, vtest_dir, work],
                           check=True)
            compare(ours, work)


if __name__ == "__main__":
    main()
