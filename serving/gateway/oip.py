"""Open Inference Protocol (KServe v2) over HTTP: request parsing and response encoding.

Both forms of the protocol are supported, in requests and in responses:

* JSON: each tensor's ``data`` is a (flat or nested) list in row-major order;
* binary: the JSON header is followed by the raw little-endian bytes of the tensors that carry
  ``parameters.binary_data_size``, in order; the header's length is in the
  ``Inference-Header-Content-Length`` HTTP header.  ``tritonclient.http`` uses this by default.

Outputs may be asked for by name, as binary (``parameters.binary_data``) or as a Triton-style
classification (``parameters.classification: k`` -> BYTES ``"score:index:label"``).  A tensor may
name a registered shared-memory region instead of carrying its data (``parameters.
shared_memory_region`` and its byte size and offset, :mod:`.shared_memory`); the parse keeps the
reference, and the prediction path reads (and writes) the region.  Everything
the client gets wrong raises :class:`InputError` with a sentence saying what and where.
"""

from __future__ import annotations

import json
import reprlib
import struct
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from sensai.merge import top_k

from ..core.contract import Prediction
from ..core.errors import InputError, PayloadTooLarge
from .shared_memory import SharedRef, shared_ref

if TYPE_CHECKING:
    from sensai.spec import DatasetSpec

INPUT_NAME = "input"
OUTPUTS = ("scores", "class_index")
HEADER_LENGTH = "Inference-Header-Content-Length"
MAX_RANK = 8
BINARY_CONTENT_TYPE = "application/octet-stream"
# One encoder (json.dumps with any non-default argument builds a new one per call).
JSON = json.JSONEncoder(separators=(",", ":"))

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
    array: np.ndarray | None  # None until read from ``shared``
    shared: SharedRef | None = None


@dataclass
class RequestedOutput:
    name: str
    binary: bool | None = None
    classification: int = 0
    shared: SharedRef | None = None  # written to a shared-memory region, not answered


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
    if not d.eof:
        raise InputError(f"request body is truncated {enc} data (the stream does not end)")
    if d.unused_data:  # what follows the stream is no part of the request
        raise InputError(f"request body has {len(d.unused_data):,} bytes after its {enc} "
                         "stream")
    return out


def decode_request(body: bytes, encoding: str | None, limit: int,
                   header_length: str | None) -> InferRequest:
    """A request body as sent (maybe compressed) -> the parsed inference request."""
    return parse_infer_request(decode_content(body, encoding, limit), header_length)


def bounded_shape(v: Any, where: str, max_elements: int) -> list[int]:
    """A tensor's shape, bounded before any arithmetic: rank, every dimension, and the element
    count (which no request body of the size limit can exceed)."""
    if not isinstance(v, list):
        raise InputError(f"{where}: 'shape' must be a list of non-negative integers")
    if len(v) > MAX_RANK:
        raise InputError(f"{where}: 'shape' has {len(v)} dimensions; at most {MAX_RANK}")
    n = 1
    for d in v:
        if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d <= max_elements:
            huge = isinstance(d, int) and abs(d) >= 10 ** 12
            raise InputError(f"{where}: 'shape' must hold integers from 0 to {max_elements:,} "
                             f"(got {'a huge number' if huge else reprlib.repr(d)})")
        n *= d
        if n > max_elements:
            raise InputError(f"{where}: shape {v} has more elements than this request's data "
                             f"can hold (at most {max_elements:,}): is its data complete?")
    return v


def num_elements(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _bounded_int(text: str) -> int:
    # Python refuses to parse integers of more than 4,300 digits (ValueError) after spending
    # quadratic time on them; no tensor value or dimension needs more than 19.
    if len(text.lstrip("-")) > 19:
        raise InputError(f"an integer of {len(text)} digits in the request")
    return int(text)


def _params(obj: dict, where: str) -> dict:
    p = obj.get("parameters", {})
    if p is None:
        return {}
    if not isinstance(p, dict):
        raise InputError(f"{where}: 'parameters' must be an object")
    return p


def _flag(params: dict, key: str, where: str) -> bool | None:
    """A true/false parameter (None: not given); a string such as "false" is refused, not
    taken as true."""
    v = params.get(key)
    if v is not None and not isinstance(v, bool):
        raise InputError(f"{where}: parameter {key!r} must be true or false, got "
                         f"{reprlib.repr(v)}")
    return v


def _json_data(data: Any, dt: np.dtype, datatype: str, shape: list[int], where: str) -> np.ndarray:
    try:
        arr = np.asarray(data)
    except (ValueError, TypeError) as e:
        raise InputError(f"{where}: 'data' is not a regular array: {e}") from None
    if arr.dtype.kind not in "biuf" or (arr.dtype.kind == "b" and datatype != "BOOL"):
        raise InputError(f"{where}: 'data' must hold {datatype} numbers")
    if arr.size != num_elements(shape):
        raise InputError(f"{where}: shape {shape} needs {num_elements(shape)} elements, "
                         f"'data' has {arr.size}")
    try:
        with np.errstate(over="raise", invalid="ignore"):
            out = arr.astype(dt).reshape(shape)
    except (FloatingPointError, OverflowError, ValueError) as e:
        raise InputError(f"{where}: values do not fit {datatype}: {e}") from None
    if arr.dtype.kind == "f" and dt.kind in "iu" and not np.array_equal(out, arr.reshape(shape)):
        raise InputError(f"{where}: {datatype} data must be integers")
    return out


def parse_input(t: Any, k: int, body_bytes: int, binary: memoryview, offset: int,
                header_length: str | None) -> tuple[InputTensor, int]:
    """Input ``k`` of a request (``t``, its JSON): the tensor, and where the next binary tensor
    starts in ``binary`` (the bytes after the JSON header) past ``offset``."""
    where = f"input {k}"
    if not isinstance(t, dict):
        raise InputError(f"{where} must be an object")
    name = t.get("name")
    if not isinstance(name, str) or not name:
        raise InputError(f"{where}: 'name' must be a non-empty string")
    where = f"input {name!r}"
    datatype = t.get("datatype")
    if not isinstance(datatype, str) or datatype not in DTYPES:
        raise InputError(f"{where}: unsupported datatype {reprlib.repr(datatype)} "
                         f"(one of {', '.join(DTYPES)})")
    dt = DTYPES[datatype]
    tensor_params = _params(t, where)
    shared = shared_ref(tensor_params, where)
    if shared is not None:  # its bytes are bounded by the region, checked when read
        if "data" in t or "binary_data_size" in tensor_params:
            raise InputError(f"{where}: data both in shared memory and in the request")
        shape = bounded_shape(t.get("shape"), where, shared.byte_size)
        return InputTensor(name, datatype, shape, None, shared), offset
    shape = bounded_shape(t.get("shape"), where, max(1, body_bytes))
    size = tensor_params.get("binary_data_size")
    if size is not None:
        if "data" in t:
            raise InputError(f"{where}: data both in the JSON ('data') and in binary "
                             "(binary_data_size): send one")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InputError(f"{where}: binary_data_size must be a non-negative integer")
        if header_length is None:
            raise InputError(f"{where} has binary_data_size but the request has no "
                             f"{HEADER_LENGTH} header")
        if offset + size > len(binary):
            raise InputError(f"{where}: binary_data_size {size} runs past the end of the "
                             f"body ({len(binary) - offset} bytes left)")
        want = num_elements(shape) * dt.itemsize
        if size != want:
            raise InputError(f"{where}: shape {shape} of {datatype} needs {want} bytes, "
                             f"binary_data_size is {size}")
        arr = np.frombuffer(binary[offset:offset + size], dtype=dt).reshape(shape)
        return InputTensor(name, datatype, shape, arr), offset + size
    if "data" in t:
        return InputTensor(name, datatype, shape,
                           _json_data(t["data"], dt, datatype, shape, where)), offset
    raise InputError(f"{where} has neither 'data' nor parameters.binary_data_size")


def parse_infer_request(body: bytes, header_length: str | None) -> InferRequest:
    """The body of ``POST /v2/models/{m}/infer`` (JSON, or JSON header + binary tensors).

    The work is bounded by the body's size: no tensor can claim more elements than the body
    could carry (one byte each in JSON, their item size in binary)."""
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
        req = json.loads(head, parse_int=_bounded_int)
    except RecursionError:
        raise InputError("inference request header is nested too deeply") from None
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
        tensor, offset = parse_input(t, k, len(body), binary, offset, header_length)
        inputs.append(tensor)
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
            binary_flag = _flag(p, "binary_data", f"output {o['name']!r}")
            cls = p.get("classification", 0)
            if not isinstance(cls, int) or isinstance(cls, bool) or cls < 0:
                raise InputError(f"output {o['name']!r}: classification must be a count >= 0")
            outputs.append(RequestedOutput(o["name"], None if binary_flag is None
                                           else binary_flag, cls,
                                           shared_ref(p, f"output {o['name']!r}")))
    return InferRequest(rid, inputs, outputs,
                        bool(_flag(params, "binary_data_output", "request")), params)


def _bytes_tensor(strings: Sequence[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(s)) + s for s in strings)


def classification(scores: np.ndarray, k: int, labels: Sequence[str]) -> np.ndarray:
    """Triton's classification extension: ``"score:index:label"`` for the k best, per row."""
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
        if isinstance(binary, SharedRef):
            # Written to the region already; no parameters, as Triton answers: its C++ client
            # (perf_analyzer) reads binary_data_size from any output that has them.
            pass
        elif binary:
            raw = tensor_bytes(arr)
            t["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        elif datatype == "BYTES":
            t["data"] = [s.decode() for s in arr.reshape(-1)]
        else:
            t["data"] = arr.reshape(-1).tolist()
        tensors.append(t)
    head["outputs"] = tensors
    js = JSON.encode(head).encode()
    if not blobs:
        return js, {}, "application/json"
    return js + b"".join(blobs), {HEADER_LENGTH: str(len(js))}, BINARY_CONTENT_TYPE


# --------------------------------------------------------------------------------------------
# The model's side of the protocol (shared by HTTP and gRPC)


def check_batch(x: np.ndarray, spec: "DatasetSpec", max_batch: int) -> np.ndarray:
    """Validate a normalized input batch before any subnet sees it (shape, dtype, finite values)."""
    if not isinstance(x, np.ndarray):
        raise InputError("input must be an array")
    if x.dtype != np.float32:
        raise InputError(f"input must be FP32, got {x.dtype}")
    want = tuple(spec.input_shape)
    if x.ndim != 4 or tuple(x.shape[1:]) != want:
        raise InputError(f"input shape must be [batch, {', '.join(map(str, want))}], "
                         f"got {list(x.shape)}")
    if not 1 <= x.shape[0] <= max_batch:
        raise InputError(f"batch size must be between 1 and {max_batch}, got {x.shape[0]}")
    if not np.isfinite(x).all():
        raise InputError("input contains NaN or infinite values: send normalized pixels "
                         "(a benchmark client's random bits are refused; perf_analyzer takes "
                         "real images from `sensai perf-data ART --out FILE` as --input-data "
                         "FILE, or --input-data zero)")
    return np.ascontiguousarray(x)


def input_batch(req: InferRequest, spec: "DatasetSpec", max_batch: int) -> np.ndarray:
    """The model's input batch from a parsed request, checked."""
    if len(req.inputs) != 1:
        raise InputError(f"model takes exactly one input {INPUT_NAME!r}, got {len(req.inputs)}")
    t = req.inputs[0]
    if t.name != INPUT_NAME:
        raise InputError(f"unknown input {t.name!r}; the model's input is {INPUT_NAME!r}")
    if t.datatype != "FP32":
        raise InputError(f"input {INPUT_NAME!r} must be FP32, got {t.datatype}")
    want = list(spec.input_shape)
    if len(t.shape) != 4 or t.shape[1:] != want:
        raise InputError(f"input {INPUT_NAME!r} must have shape [batch, "
                         f"{', '.join(map(str, want))}], got {t.shape}")
    return check_batch(t.array, spec, max_batch)


def allow_partial(req: InferRequest) -> bool:
    value = req.parameters.get("allow_partial", False)
    if not isinstance(value, bool):
        raise InputError(f"parameters.allow_partial must be true or false, got {value!r}")
    return value


def infer_outputs(req: InferRequest, scores: np.ndarray, classes: Sequence[str],
                  covered: list[int] | None = None
                  ) -> list[tuple[str, np.ndarray, bool | SharedRef]]:
    """The requested outputs (all by default) as ``(name, array, binary? or the shared-memory
    region it goes to)``.  In a degraded
    answer (``covered``) the scores of unanswered classes are 0 and rankings never name them."""
    ranked = scores
    if covered is not None:
        ranked = np.full_like(scores, -np.inf)
        ranked[:, covered] = scores[:, covered]
    wanted = req.outputs if req.outputs is not None else [RequestedOutput(n) for n in OUTPUTS]
    if not wanted:
        raise InputError("'outputs' is empty: ask for 'scores' and/or 'class_index'")
    out = []
    for o in wanted:
        if o.name not in OUTPUTS:
            raise InputError(f"unknown output {o.name!r}; outputs are {', '.join(OUTPUTS)}")
        binary = req.binary_output if o.binary is None else o.binary
        if o.classification:
            k = o.classification if covered is None else min(o.classification, len(covered))
            arr = classification(ranked, k, classes)
        elif o.name == "scores":
            arr = scores.astype(np.float32, copy=False)
        else:
            arr = ranked.argmax(axis=1).astype(np.int64)
        out.append((o.name, arr, o.shared or binary))
    return out


def tensor_bytes(arr: np.ndarray) -> bytes:
    """A tensor's bytes as the protocol carries them (BYTES: each element's length, then it)."""
    if arr.dtype.kind in ("S", "O", "U"):
        return _bytes_tensor(list(arr.reshape(-1)))
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()


def response_parameters(pred: Prediction) -> dict[str, Any]:
    params: dict[str, Any] = {"timings_ms": json.dumps(pred.timings_ms)}
    if pred.degraded:
        params.update(degraded=True, covered_classes=json.dumps(pred.covered_classes),
                      missing_classes=json.dumps(pred.missing_classes))
    return params
