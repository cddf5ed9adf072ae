"""Open Inference Protocol (KServe v2) over HTTP: request parsing and response encoding.

Both forms of the protocol are supported, in requests and in responses:

* JSON: each tensor's ``data`` is a (flat or nested) list in row-major order;
* binary: the JSON header is followed by the raw little-endian bytes of the tensors that carry
  ``parameters.binary_data_size``, in order; the header's length is in the
  ``Inference-Header-Content-Length`` HTTP header.  ``tritonclient.http`` uses this by default.

Outputs may be asked for by name, as binary (``parameters.binary_data``) or as a Triton-style
classification (``parameters.classification: k`` -> BYTES ``"score:index:label"``).  Everything
the client gets wrong raises :class:`InputError` with a sentence saying what and where.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .predictor import InputError, PayloadTooLarge

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_CONTENT_TYPE = "application/octet-stream"

DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("?"), "UINT8": np.dtype("u1"), "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"), "UINT64": np.dtype("<u8"), "INT8": np.dtype("i1"),
    "INT16": np.dtype("<i2"), "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
}
_NP_TO_V2 = {v.newbyteorder("="): k for k, v in DTYPES.items()}


def v2_datatype(arr: np.ndarray) -> str:
    if arr.dtype.kind in ("S", "O", "U"):
        return "BYTES"
    return _NP_TO_V2[arr.dtype.newbyteorder("=")]


@dataclass
class InputTensor:
    name: str
    datatype: str
    shape: list[int]
    array: np.ndarray


@dataclass
class RequestedOutput:
    name: str
    binary: bool | None = None
    classification: int = 0


@dataclass
class InferRequest:
    id: str | None
    inputs: list[InputTensor]
    outputs: list[RequestedOutput] | None  # None: every output
    binary_output: bool = False
    parameters: dict[str, Any] = field(default_factory=dict)


def decode_content(body: bytes, encoding: str | None, limit: int) -> bytes:
    """Undo ``Content-Encoding: gzip|deflate`` without letting the result exceed ``limit``."""
    enc = (encoding or "identity").strip().lower()
    if enc in ("identity", ""):
        return body
    if enc not in ("gzip", "deflate"):
        raise InputError(f"unsupported Content-Encoding {encoding!r} (use gzip, deflate or none)",
                         status=415)
    d = zlib.decompressobj(wbits=31 if enc == "gzip" else 15)
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as e:
        raise InputError(f"request body is not valid {enc} data: {e}") from None
    if len(out) > limit or d.unconsumed_tail:
        raise PayloadTooLarge(f"request body decompresses to more than {limit:,} bytes")
    return out


def _shape(v: Any, where: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                          for d in v):
        raise InputError(f"{where}: 'shape' must be a list of non-negative integers, got {v!r}")
    return v


def _num_elements(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _params(obj: dict, where: str) -> dict:
    p = obj.get("parameters", {})
    if p is None:
        return {}
    if not isinstance(p, dict):
        raise InputError(f"{where}: 'parameters' must be an object")
    return p


def _json_data(data: Any, dt: np.dtype, datatype: str, shape: list[int], where: str) -> np.ndarray:
    try:
        arr = np.asarray(data)
    except (ValueError, TypeError) as e:
        raise InputError(f"{where}: 'data' is not a regular array: {e}") from None
    if arr.dtype.kind not in "biuf" or (arr.dtype.kind == "b" and datatype != "BOOL"):
        raise InputError(f"{where}: 'data' must hold {datatype} numbers")
    if arr.size != _num_elements(shape):
        raise InputError(f"{where}: shape {shape} needs {_num_elements(shape)} elements, "
                         f"'data' has {arr.size}")
    try:
        with np.errstate(over="raise", invalid="ignore"):
            out = arr.astype(dt).reshape(shape)
    except (FloatingPointError, OverflowError, ValueError) as e:
        raise InputError(f"{where}: values do not fit {datatype}: {e}") from None
    if arr.dtype.kind == "f" and dt.kind in "iu" and not np.array_equal(out, arr.reshape(shape)):
        raise InputError(f"{where}: {datatype} data must be integers")
    return out


def parse_infer_request(body: bytes, header_length: str | None) -> InferRequest:
    """The body of ``POST /v2/models/{m}/infer`` (JSON, or JSON header + binary tensors)."""
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            raise InputError(f"{HEADER_LENGTH} must be an integer, got {header_length!r}") from None
        if not 0 < n <= len(body):
            raise InputError(f"{HEADER_LENGTH} is {n} but the body has {len(body)} bytes")
        head, binary = body[:n], memoryview(body)[n:]
    else:
        head, binary = body, memoryview(b"")
    if not head.strip():
        raise InputError("empty inference request: expected a JSON object with 'inputs'")
    try:
        req = json.loads(head)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        hint = "" if header_length else f" (binary tensors need the {HEADER_LENGTH} header)"
        raise InputError(f"inference request header is not valid JSON: {e}{hint}") from None
    if not isinstance(req, dict):
        raise InputError("inference request must be a JSON object")
    rid = req.get("id")
    if rid is not None and not isinstance(rid, str):
        raise InputError("'id' must be a string")
    params = _params(req, "request")
    raw_inputs = req.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InputError("'inputs' must be a non-empty list of tensors")
    inputs, offset = [], 0
    for k, t in enumerate(raw_inputs):
        where = f"input {k}"
        if not isinstance(t, dict):
            raise InputError(f"{where} must be an object")
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise InputError(f"{where}: 'name' must be a non-empty string")
        where = f"input {name!r}"
        datatype = t.get("datatype")
        if datatype not in DTYPES:
            raise InputError(f"{where}: unsupported datatype {datatype!r} "
                             f"(one of {', '.join(DTYPES)})")
        dt = DTYPES[datatype]
        shape = _shape(t.get("shape"), where)
        size = _params(t, where).get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise InputError(f"{where}: binary_data_size must be a non-negative integer")
            if header_length is None:
                raise InputError(f"{where} has binary_data_size but the request has no "
                                 f"{HEADER_LENGTH} header")
            if offset + size > len(binary):
                raise InputError(f"{where}: binary_data_size {size} runs past the end of the "
                                 f"body ({len(binary) - offset} bytes left)")
            want = _num_elements(shape) * dt.itemsize
            if size != want:
                raise InputError(f"{where}: shape {shape} of {datatype} needs {want} bytes, "
                                 f"binary_data_size is {size}")
            arr = np.frombuffer(binary[offset:offset + size], dtype=dt).reshape(shape)
            offset += size
        elif "data" in t:
            arr = _json_data(t["data"], dt, datatype, shape, where)
        else:
            raise InputError(f"{where} has neither 'data' nor parameters.binary_data_size")
        inputs.append(InputTensor(name, datatype, shape, arr))
    if offset != len(binary):
        raise InputError(f"{len(binary) - offset} bytes of binary data follow the tensors "
                         "(binary_data_size values do not add up)")
    outputs = None
    if "outputs" in req:
        raw_out = req["outputs"]
        if not isinstance(raw_out, list):
            raise InputError("'outputs' must be a list")
        outputs = []
        for o in raw_out:
            if not isinstance(o, dict) or not isinstance(o.get("name"), str):
                raise InputError("each requested output needs a 'name'")
            p = _params(o, f"output {o['name']!r}")
            binary_flag = p.get("binary_data")
            cls = p.get("classification", 0)
            if not isinstance(cls, int) or isinstance(cls, bool) or cls < 0:
                raise InputError(f"output {o['name']!r}: classification must be a count >= 0")
            outputs.append(RequestedOutput(o["name"], None if binary_flag is None
                                           else bool(binary_flag), cls))
    return InferRequest(rid, inputs, outputs, bool(params.get("binary_data_output", False)), params)


def _bytes_tensor(strings: Sequence[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(s)) + s for s in strings)


def classification(scores: np.ndarray, k: int, labels: Sequence[str]) -> np.ndarray:
    """Triton's classification extension: ``"score:index:label"`` for the k best, per row."""
    from sensai.merge import top_k

    idx, val = top_k(scores, k)
    rows = [[f"{v:f}:{i}:{labels[i]}".encode() for i, v in zip(ri, rv)] for ri, rv in zip(idx, val)]
    return np.array(rows, dtype=object)


def encode_infer_response(*, model_name: str, model_version: str, request_id: str | None,
                          outputs: list[tuple[str, np.ndarray, bool]],
                          parameters: dict | None = None) -> tuple[bytes, dict[str, str], str]:
    """``outputs``: (name, array, binary?) -> (body, extra headers, media type)."""
    head: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request_id is not None:
        head["id"] = request_id
    if parameters:
        head["parameters"] = parameters
    tensors, blobs = [], []
    for name, arr, binary in outputs:
        datatype = v2_datatype(arr)
        t: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(arr.shape)}
        if binary:
            raw = (_bytes_tensor(list(arr.reshape(-1))) if datatype == "BYTES"
                   else np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes())
            t["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        elif datatype == "BYTES":
            t["data"] = [s.decode() for s in arr.reshape(-1)]
        else:
            t["data"] = arr.reshape(-1).tolist()
        tensors.append(t)
    head["outputs"] = tensors
    js = json.dumps(head, separators=(",", ":")).encode()
    if not blobs:
        return js, {}, "application/json"
    return js + b"".join(blobs), {HEADER_LENGTH: str(len(js))}, BINARY_CONTENT_TYPE
