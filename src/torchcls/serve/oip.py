"""Open Inference Protocol v2 (KServe / Triton REST): model metadata, and infer request parsing and answers.

Inputs: one FP32 tensor named `input` of shape [N, C, H, W], as JSON `data` (flat or nested,
row-major) or, with the binary tensor extension, as raw little-endian bytes after the JSON
header (`Inference-Header-Content-Length` + `parameters.binary_data_size`). Outputs:
`logits` and `probabilities` (FP32 [N, K]) and `labels` (BYTES [N], the top-1 class names), as JSON,
or as raw bytes after the JSON header when asked (`parameters.binary_data_output` for the request,
`parameters.binary_data` per output, as tritonclient sends). The JSON is parsed at a cost bounded by
the declared shape (serve/tensor_json.py).
A multilabel model (its artifact's task): `probabilities` are one sigmoid per class, and each `labels`
entry names every class at or above its threshold, joined by ';' (empty: none).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import torch

from torchcls.artifacts.artifact import ArtifactInfo
from torchcls.serve.http_errors import HTTPError
from torchcls.serve.tensor_json import load_request, parse_data
from torchcls.tasks import labels_above

INPUT_NAME = "input"
OUTPUTS = ("logits", "probabilities", "labels")
BINARY_HEADER = "inference-header-content-length"


def model_metadata(name: str, info: ArtifactInfo) -> dict[str, Any]:
    pre, k = info.preprocess, len(info.classes)
    return {
        "name": name, "versions": ["1"], "platform": f"torchcls_{info.target}",
        "inputs": [{"name": INPUT_NAME, "datatype": "FP32", "shape": [-1, pre.channels, pre.img_size, pre.img_size]}],
        "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, k]},
                    {"name": "probabilities", "datatype": "FP32", "shape": [-1, k]},
                    {"name": "labels", "datatype": "BYTES", "shape": [-1]}],
        "parameters": {"classes": info.classes, "max_batch": info.max_batch, "precision": info.precision,
                       "task": info.task, **({"thresholds": thresholds(info).tolist()} if info.task == "multilabel"
                                            else {}),
                       "preprocess": {"img_size": pre.img_size, "channels": pre.channels,
                                      "mean": list(pre.mean), "std": list(pre.std),
                                      "interpolation": pre.interpolation, "crop_pct": pre.crop_pct}},
    }


def _split_binary(body: bytes | bytearray, header_length: str | None) -> tuple[bytes | bytearray, memoryview]:
    if header_length is None:
        return body, memoryview(b"")
    try:
        n = int(header_length)
    except ValueError:
        raise HTTPError(400, f"Inference-Header-Content-Length {header_length!r} is not an integer") from None
    if not 0 < n <= len(body):
        raise HTTPError(400, f"Inference-Header-Content-Length {n} is outside the body's {len(body)} bytes")
    return body[:n], memoryview(body)[n:]


def _check_shape(spec: dict[str, Any], info: ArtifactInfo, max_batch: int) -> list[int]:
    pre = info.preprocess
    expected = [pre.channels, pre.img_size, pre.img_size]
    shape = spec.get("shape")
    if (not isinstance(shape, list) or len(shape) != 4
            or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)):
        raise HTTPError(400, f"input 'shape' must be [N, {', '.join(map(str, expected))}], got {shape!r}")
    if shape[1:] != expected:
        raise HTTPError(400, f"input shape {shape} does not match this model's [N, "
                             f"{', '.join(map(str, expected))}]")
    if shape[0] < 1:
        raise HTTPError(400, f"input batch {shape[0]} must be at least 1")
    if shape[0] > max_batch:
        raise HTTPError(400, f"input batch {shape[0]} is above this server's max batch {max_batch}; "
                             "split the request")
    return shape


def _tensor_data(spec: dict[str, Any], binary: memoryview, count: int) -> np.ndarray:
    size = (spec.get("parameters") or {}).get("binary_data_size")
    if size is not None:
        if size != count * 4 or len(binary) != size:
            raise HTTPError(400, f"binary_data_size {size} and the {len(binary)} bytes after the JSON header "
                                 f"must both equal {count} FP32 values = {count * 4} bytes")
        return np.frombuffer(binary, dtype="<f4")
    if "data" not in spec:
        raise HTTPError(400, "input has no 'data' (nor parameters.binary_data_size with a binary body)")
    try:
        arr = np.array(spec["data"], dtype=np.float32)  # straight to float32: the cheapest path from JSON
    except (ValueError, TypeError) as e:  # strings, objects, ragged nesting
        raise HTTPError(400, f"input 'data' must be a regular array of numbers: {e}") from None
    if arr.size != count:
        raise HTTPError(400, f"input 'data' has {arr.size} values; shape requires {count}")
    return arr.reshape(-1)


def parse_infer(body: bytes | bytearray, header_length: str | None, info: ArtifactInfo,
                max_batch: int) -> tuple[torch.Tensor, dict]:
    """An infer request -> (float32 NCHW tensor, the request JSON); any fault -> HTTPError 400.

    `max_batch` is the server's bound (--max-batch), which may be below the artifact's. Only the
    request's envelope is parsed before `shape` is checked; `data` is parsed after it, bounded by it."""
    text, binary = _split_binary(body, header_length)
    request, spans = load_request(text)
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise HTTPError(400, f"'inputs' must be a list with one tensor named '{INPUT_NAME}'")
    spec = inputs[0]
    if spec.get("name", INPUT_NAME) != INPUT_NAME:
        raise HTTPError(400, f"unknown input {spec.get('name')!r}; this model has one input '{INPUT_NAME}'")
    if spec.get("datatype") != "FP32":
        raise HTTPError(400, f"input datatype {spec.get('datatype')!r} is not supported; send FP32")
    shape = _check_shape(spec, info, max_batch)
    params = spec.get("parameters") or {}
    if not isinstance(params, dict):
        raise HTTPError(400, f"input 'parameters' must be an object, got {params!r:.80}")
    data = None if "binary_data_size" in params else parse_data(text, spans, spec.get("data"), shape)
    if data is None:
        data = _tensor_data(spec, binary, int(np.prod(shape)))
    if not np.isfinite(data).all():
        raise HTTPError(400, "input 'data' holds NaN or infinite values")
    return torch.from_numpy(data.reshape(shape).copy()), request


def requested_outputs(request: dict[str, Any]) -> list[str]:
    wanted = request.get("outputs")
    if wanted is None:
        return list(OUTPUTS)
    if not isinstance(wanted, list) or not all(isinstance(o, dict) for o in wanted):
        raise HTTPError(400, "'outputs' must be a list of objects with a 'name'")
    names = [o.get("name") for o in wanted]
    unknown = [n for n in names if n not in OUTPUTS]
    if unknown:
        raise HTTPError(400, f"unknown output(s) {unknown}; this model has {list(OUTPUTS)}")
    # Each named output is serialised in full: a repeated name would multiply the response size.
    if len(set(names)) != len(names):
        raise HTTPError(400, f"'outputs' names an output more than once: {names}")
    return names


def binary_outputs(request: dict[str, Any], outputs: list[str]) -> frozenset[str]:
    """The outputs to answer as raw bytes: each output's `parameters.binary_data`, else the request's
    `parameters.binary_data_output` (tritonclient sets it when it names no output), else JSON."""
    def flag(params: Any, key: str, where: str) -> bool | None:
        if params is None:
            return None
        if not isinstance(params, dict) or not isinstance(params.get(key, False), bool):
            raise HTTPError(400, f"{where} 'parameters' must be an object whose '{key}' is true or false")
        return params.get(key)

    default = flag(request.get("parameters"), "binary_data_output", "the request's") or False
    per_output = {o.get("name"): flag(o.get("parameters"), "binary_data", "an output's")
                  for o in request.get("outputs") or []}
    return frozenset(o for o in outputs if (default if per_output.get(o) is None else per_output[o]))


def _bytes_tensor(items: list[str]) -> bytes:
    """BYTES elements in the binary extension: each a 4-byte little-endian length, then the bytes."""
    encoded = [s.encode() for s in items]
    return b"".join(len(e).to_bytes(4, "little") + e for e in encoded)


def infer_response(name: str, request: dict[str, Any], outputs: list[str], logits: np.ndarray,
                   probs: np.ndarray, top1: np.ndarray, classes: list[str],
                   label_thresholds: np.ndarray | None = None,
                   binary: frozenset[str] = frozenset()) -> tuple[bytes, int | None]:
    """The answer, and the length of its JSON header when outputs in `binary` follow it as raw bytes
    (the Inference-Header-Content-Length response header), else None. Numpy in (no torch call here: this
    runs on the event loop). With `label_thresholds` (multilabel) each `labels` entry is every class at
    or above its threshold, ';'-joined."""
    n, k = logits.shape
    if label_thresholds is not None:
        names = [";".join(d["label"] for d in labels_above(p, label_thresholds.tolist(), classes))
                 for p in probs.tolist()]
    else:
        names = [classes[i] for i in top1.tolist()]
    tensors = {
        "logits": ("FP32", [n, k], lambda: logits.reshape(-1), lambda: logits.astype("<f4").tobytes()),
        "probabilities": ("FP32", [n, k], lambda: probs.reshape(-1), lambda: probs.astype("<f4").tobytes()),
        "labels": ("BYTES", [n], lambda: names, lambda: _bytes_tensor(names)),
    }
    entries, raw = [], []
    for o in outputs:
        datatype, shape, as_json, as_bytes = tensors[o]
        if o in binary:
            raw.append(as_bytes())
            entries.append({"name": o, "datatype": datatype, "shape": shape,
                            "parameters": {"binary_data_size": len(raw[-1])}})
        else:
            entries.append({"name": o, "datatype": datatype, "shape": shape, "data": as_json()})
    answer: dict[str, Any] = {"model_name": name, "model_version": "1", "outputs": entries}
    if "id" in request:
        answer["id"] = request["id"]
    header = orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY)
    return (header + b"".join(raw), len(header)) if raw else (header, None)


def thresholds(info: ArtifactInfo) -> np.ndarray | None:
    """A multilabel artifact's per-class thresholds (0.5 where it carries none); None for multiclass."""
    if info.task != "multilabel":
        return None
    return np.asarray(info.thresholds or [0.5] * len(info.classes), dtype=np.float32)

