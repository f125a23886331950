"""The KServe v2 binary tensor extension, shared by the Python peers.

A request or response body is a JSON header of `Inference-Header-Content-Length`
bytes followed by the tensors' raw bytes, in the order the header lists them,
each `parameters.binary_data_size` long.
"""

import json

import numpy as np

HEADER = "inference-header-content-length"

DTYPES = {
    "UINT8": np.uint8,
    "FP32": np.float32,
    "FP16": np.float16,
    "INT32": np.int32,
    "INT64": np.int64,
}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


class BadRequest(ValueError):
    """A request that does not follow the protocol; the message says why."""


def parse_request(body: bytes, header_len: str | None):
    """Returns (request id, {input name: ndarray}, [requested output names])."""
    if header_len is None:
        raise BadRequest("missing Inference-Header-Content-Length")
    try:
        n = int(header_len)
    except ValueError:
        raise BadRequest(f"Inference-Header-Content-Length {header_len!r} is not a number")
    if n < 2 or n > len(body):
        raise BadRequest(f"Inference-Header-Content-Length {n} outside the body of {len(body)} bytes")
    try:
        head = json.loads(body[:n])
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the JSON header does not parse: {e}")
    offset = n
    inputs = {}
    for spec in head.get("inputs", []):
        try:
            name, shape, dtype = spec["name"], [int(d) for d in spec["shape"]], spec["datatype"]
            size = int(spec["parameters"]["binary_data_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise BadRequest(f"input {spec!r} lacks {e}")
        if dtype not in DTYPES:
            raise BadRequest(f"input {name}: datatype {dtype} is not supported")
        want = int(np.prod(shape)) * np.dtype(DTYPES[dtype]).itemsize
        if size != want or offset + size > len(body):
            raise BadRequest(f"input {name}: {size} bytes for shape {shape} {dtype} (expected {want}, {len(body) - offset} left)")
        inputs[name] = np.frombuffer(body, dtype=DTYPES[dtype], count=int(np.prod(shape)), offset=offset).reshape(shape)
        offset += size
    if offset != len(body):
        raise BadRequest(f"{len(body) - offset} bytes after the last input")
    outputs = [o["name"] for o in head.get("outputs", []) if "name" in o]
    return head.get("id", ""), inputs, outputs


def encode_response(model: str, request_id: str, outputs: dict) -> tuple[bytes, int]:
    """The response body and its JSON header's length."""
    specs, blobs = [], []
    for name, array in outputs.items():
        array = np.ascontiguousarray(array)
        data = array.tobytes()
        specs.append({
            "name": name,
            "datatype": NAMES[array.dtype],
            "shape": list(array.shape),
            "parameters": {"binary_data_size": len(data)},
        })
        blobs.append(data)
    head = json.dumps({"model_name": model, "id": request_id, "outputs": specs}).encode()
    return head + b"".join(blobs), len(head)
