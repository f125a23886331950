"""An NVIDIA Triton peer: BlazeFace on Triton's python backend through
PyTriton (the `nvidia-pytriton` wheel), ONNX Runtime inside, dynamic batching.

Triton serves KServe v2 over HTTP (binary tensors included) on --port. Each
instance is one ONNX Runtime session with --threads intra-op threads; the
dynamic batcher groups requests up to --max-batch, holding a request at most
--queue-delay-us.

    python triton_server.py --model-dir models/blazeface --port 8000 --instances 2 --threads 1
"""

import argparse
import logging
import os
import signal
import sys

import numpy as np
import onnxruntime as ort
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig


def make_instance(path: str, threads: int):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    input_name = session.get_inputs()[0].name
    names = [o.name for o in session.get_outputs()]

    @batch
    def infer(**inputs):
        (frames,) = inputs.values()
        # As the tidegate worker: u8 RGB NHWC -> f32, (x - 127.5) / 127.5.
        x = (frames.astype(np.float32) - 127.5) / 127.5
        return dict(zip(names, session.run(names, {input_name: x})))

    return session, infer


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--model", default="blazeface")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--queue-delay-us", type=int, default=2000)
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    path = os.path.join(os.path.abspath(a.model_dir), "model.onnx")
    instances = [make_instance(path, a.threads) for _ in range(a.instances)]
    session = instances[0][0]
    inp = session.get_inputs()[0]
    inputs = [Tensor(name=inp.name, dtype=np.uint8, shape=(inp.shape[1], inp.shape[2], 3))]
    outputs = [Tensor(name=o.name, dtype=np.float32, shape=tuple(o.shape[1:])) for o in session.get_outputs()]
    config = TritonConfig(http_address="127.0.0.1", http_port=a.port, grpc_address="127.0.0.1",
                          grpc_port=a.port + 1, metrics_port=a.port + 2, log_verbose=0)
    with Triton(config=config) as triton:
        triton.bind(
            model_name=a.model,
            infer_func=[f for _, f in instances],
            inputs=inputs,
            outputs=outputs,
            config=ModelConfig(max_batch_size=a.max_batch,
                               batcher=DynamicBatcher(max_queue_delay_microseconds=a.queue_delay_us)),
            strict=True,
        )
        print(f"listening on 127.0.0.1:{a.port}", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        triton.serve()


if __name__ == "__main__":
    main()
