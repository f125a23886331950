"""A FastAPI + onnxruntime peer: BlazeFace behind KServe v2 (binary tensors).

What a team writes when it puts a model behind HTTP itself: one ONNX Runtime
session per uvicorn worker process, preprocessing in numpy, no batching.

    python fastapi_server.py --model-dir models/blazeface --port 8001 --workers 2 --threads 1
"""

import argparse
import os
import sys

import numpy as np
import onnxruntime as ort
import uvicorn
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kserve_binary import HEADER, BadRequest, encode_response, parse_request  # noqa: E402

MODEL = os.environ.get("PEER_MODEL", "blazeface")
app = FastAPI()
_session = None


def session():
    global _session
    if _session is None:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = int(os.environ.get("PEER_THREADS", "1"))
        opts.inter_op_num_threads = 1
        path = os.path.join(os.environ["PEER_MODEL_DIR"], "model.onnx")
        _session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    return _session


def infer(frame: np.ndarray) -> dict:
    # As the tidegate worker: u8 RGB NHWC -> f32, (x - 127.5) / 127.5.
    x = (frame.astype(np.float32) - 127.5) / 127.5
    s = session()
    names = [o.name for o in s.get_outputs()]
    return dict(zip(names, s.run(names, {s.get_inputs()[0].name: x})))


@app.get("/v2/health/ready")
def ready():
    session()
    return {"ready": True}


@app.get("/v2/models/{name}/ready")
def model_ready(name: str):
    if name != MODEL:
        return JSONResponse({"error": f"unknown model '{name}'"}, status_code=404)
    session()
    return {"name": MODEL, "ready": True}


@app.get("/v2/models/{name}")
def metadata(name: str):
    if name != MODEL:
        return JSONResponse({"error": f"unknown model '{name}'"}, status_code=404)
    s = session()
    # KServe v2 model metadata: a dynamic dimension is -1. The input is what
    # clients send (u8 RGB NHWC), not the model's f32 tensor.
    dims = lambda shape: [d if isinstance(d, int) else -1 for d in shape]
    (inp,) = s.get_inputs()
    return {
        "name": MODEL,
        "versions": ["1"],
        "platform": "onnxruntime_onnx",
        "inputs": [{"name": inp.name, "datatype": "UINT8", "shape": dims(inp.shape)}],
        "outputs": [{"name": o.name, "datatype": "FP32", "shape": dims(o.shape)} for o in s.get_outputs()],
    }


@app.post("/v2/models/{name}/infer")
async def infer_route(name: str, request: Request):
    if name != MODEL:
        return JSONResponse({"error": f"unknown model '{name}'"}, status_code=404)
    body = await request.body()
    try:
        request_id, inputs, wanted = parse_request(body, request.headers.get(HEADER))
        if len(inputs) != 1:
            raise BadRequest(f"expected one input, got {len(inputs)}")
        (frame,) = inputs.values()
        if frame.dtype != np.uint8 or frame.ndim != 4 or frame.shape[3] != 3:
            raise BadRequest(f"expected UINT8 [N,H,W,3], got {frame.dtype} {list(frame.shape)}")
    except BadRequest as e:
        return JSONResponse({"error": str(e)}, status_code=400)
    outputs = await run_in_threadpool(infer, frame)
    if wanted:
        unknown = [w for w in wanted if w not in outputs]
        if unknown:
            return JSONResponse({"error": f"unknown outputs {unknown}"}, status_code=400)
        outputs = {w: outputs[w] for w in wanted}
    data, n = encode_response(MODEL, request_id, outputs)
    return Response(content=data, media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(n)})


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    os.environ["PEER_MODEL_DIR"] = os.path.abspath(a.model_dir)
    os.environ["PEER_THREADS"] = str(a.threads)
    uvicorn.run("fastapi_server:app", host="127.0.0.1", port=a.port, workers=a.workers,
                log_level="warning", app_dir=os.path.dirname(os.path.abspath(__file__)))


if __name__ == "__main__":
    main()
