"""The Open Inference Protocol (KServe v2) over gRPC, beside the HTTP gateway.

The service is the one ``tritonclient`` ships (``tritonclient.grpc.service_pb2``), so
``tritonclient.grpc.InferenceServerClient`` calls it unchanged.  It runs on the gateway's event loop
(started and stopped by the app's lifespan when ``settings.grpc_port`` is set), on the same
predictor, admission and whole-request deadline, and every inference goes through the gateway's own
path (:func:`~sensai.serving.gateway.inference.v2_infer` ->
:func:`~sensai.serving.gateway.inference.predict`): this module only converts messages and errors.
Implemented: ``ServerLive``, ``ServerReady``, ``ModelReady``, ``ServerMetadata``, ``ModelMetadata``,
``ModelConfig`` (Triton's model configuration: where the preprocessing's values are, as
``ModelMetadata`` has no field for them), ``ModelInfer`` (tensors in ``raw_input_contents``,
typed ``contents`` or a registered shared-memory region; outputs in ``raw_output_contents`` or a
region), ``ModelStreamInfer`` (each request's answer on the stream as it is done, a failure as
its ``error_message``), ``ModelStatistics``, ``SystemSharedMemory{Status,Register,Unregister}``
and the repository's ``RepositoryIndex``, ``RepositoryModelLoad``, ``RepositoryModelUnload``
(asked for what HTTP asks, :func:`~sensai.serving.gateway.repository_api.check_access`); CUDA
shared memory's status and unregister answer that there is none, its register, trace and log
settings UNIMPLEMENTED at once.

Errors map to status codes by their HTTP status (:data:`CODES`): 400 INVALID_ARGUMENT, 404
NOT_FOUND, 413 RESOURCE_EXHAUSTED (what gRPC itself answers for a message over
``max_receive_message_length``), 503 UNAVAILABLE - overload (trailing metadata ``retry-after``)
and missing classes (named in the message and in trailing metadata ``missing-classes``) alike,
as both are worth a retry - and 504 DEADLINE_EXCEEDED.  Bad input is never UNKNOWN or INTERNAL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Awaitable, Callable, NamedTuple

import grpc
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from sensai.errors import SensaiError

from ..core.contract import Prediction
from ..core.errors import InputError, Overloaded, ServingError
from . import oip
from .admission import Ticket
from .inference import (INLINE_PARSE_BYTES, Gateway, answered, count_error, server_ready,
                        statistics, v2_infer, v2_model_config, v2_model_metadata,
                        v2_server_metadata, version_ready)
from .repository_api import check_access
from .model_table import ModelVersion
from .shared_memory import SharedRef, shared_ref
from .statistics import RequestClock

log = logging.getLogger(__name__)

SERVICE = "/inference.GRPCInferenceService/"
CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
         403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
         408: grpc.StatusCode.DEADLINE_EXCEEDED, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
         415: grpc.StatusCode.INVALID_ARGUMENT, 422: grpc.StatusCode.INVALID_ARGUMENT,
         503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}
# The typed field of InferTensorContents that carries each datatype (FP16 has none: raw only).
TYPED = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
         "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
         "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
         "FP32": "fp32_contents", "FP64": "fp64_contents"}
# Typed contents above this many elements are converted in a thread (as HTTP parses JSON).
INLINE_ELEMENTS = INLINE_PARSE_BYTES // 4
GRACE_S = 5.0


# --------------------------------------------------------------------------------------------
# Messages <-> the protocol's request and response


def parameters(params) -> dict[str, Any]:
    """A protobuf ``map<string, InferParameter>`` as plain values."""
    out = {}
    for key, p in params.items():
        which = p.WhichOneof("parameter_choice")
        out[key] = getattr(p, which) if which else None
    return out


def _set_parameter(p: pb.InferParameter, value: Any) -> None:
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        p.int64_param = value
    elif isinstance(value, float):
        p.double_param = value
    else:
        p.string_param = str(value)


def _tensor(t, raw: bytes | None, k: int, max_elements: int) -> oip.InputTensor:
    if not t.name:
        raise InputError(f"input {k}: 'name' must be a non-empty string")
    where = f"input {t.name!r}"
    if t.datatype not in oip.DTYPES:
        raise InputError(f"{where}: unsupported datatype {t.datatype!r} "
                         f"(one of {', '.join(oip.DTYPES)})")
    dt = oip.DTYPES[t.datatype]
    shared = shared_ref(parameters(t.parameters), where)
    if shared is not None:  # its bytes are bounded by the region, checked when read
        if raw is not None or t.HasField("contents"):
            raise InputError(f"{where}: data both in shared memory and in the request")
        shape = oip.bounded_shape(list(t.shape), where, shared.byte_size)
        return oip.InputTensor(t.name, t.datatype, shape, None, shared)
    field = TYPED.get(t.datatype)
    # No shape may claim more elements than a message can carry (the HTTP rule, shared); the
    # exact count is checked against what was sent below.
    shape = oip.bounded_shape(list(t.shape), where, max_elements)
    n = oip.num_elements(shape)
    if raw is not None:
        if t.HasField("contents"):
            raise InputError(f"{where}: data both in raw_input_contents and in contents")
        if len(raw) != n * dt.itemsize:
            raise InputError(f"{where}: shape {shape} of {t.datatype} needs {n * dt.itemsize:,} "
                             f"bytes, its raw_input_contents has {len(raw):,}")
        return oip.InputTensor(t.name, t.datatype, shape, np.frombuffer(raw, dt).reshape(shape))
    if field is None:
        raise InputError(f"{where}: send {t.datatype} data in raw_input_contents")
    values = getattr(t.contents, field)
    if len(values) != n:
        raise InputError(f"{where}: shape {shape} needs {n:,} elements, contents.{field} has "
                         f"{len(values):,}")
    try:
        arr = np.array(values, dtype=dt).reshape(shape)
    except (OverflowError, ValueError) as e:
        raise InputError(f"{where}: values do not fit {t.datatype}: {e}") from None
    return oip.InputTensor(t.name, t.datatype, shape, arr)


def _requested(o) -> oip.RequestedOutput:
    params = parameters(o.parameters)
    k = params.get("classification", 0)
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise InputError(f"output {o.name!r}: classification must be a count >= 0")
    return oip.RequestedOutput(o.name, True, k, shared_ref(params, f"output {o.name!r}"))


def infer_request(msg: pb.ModelInferRequest, max_elements: int) -> oip.InferRequest:
    """A ``ModelInferRequest`` as the protocol's request, every tensor checked against the bytes
    or values that carry it (so no shape can claim more than the message holds).  Inputs in
    shared memory have no entry in ``raw_input_contents`` (tritonclient's rule)."""
    raw = list(msg.raw_input_contents)
    carried = [t for t in msg.inputs if "shared_memory_region" not in t.parameters]
    if raw and len(raw) != len(carried):
        raise InputError(f"raw_input_contents has {len(raw)} entries for {len(carried)} "
                         "inputs not in shared memory (one per input, or none)")
    raw_of = dict(zip((id(t) for t in carried), raw))
    inputs = [_tensor(t, raw_of.get(id(t)), k, max_elements)
              for k, t in enumerate(msg.inputs)]
    outputs = [_requested(o) for o in msg.outputs] or None  # none asked for: all of them
    return oip.InferRequest(msg.id or None, inputs, outputs, True, parameters(msg.parameters))


def typed_elements(msg: pb.ModelInferRequest) -> int:
    fields = set(TYPED.values())
    return sum(len(getattr(t.contents, f)) for t in msg.inputs for f in fields)


def infer_response(mv: ModelVersion, msg: pb.ModelInferRequest, pred: Prediction,
                   outputs: list[tuple[str, np.ndarray, bool]]) -> pb.ModelInferResponse:
    resp = pb.ModelInferResponse(model_name=mv.name, model_version=mv.version, id=msg.id)
    for key, value in oip.response_parameters(pred).items():
        _set_parameter(resp.parameters[key], value)
    for out_name, arr, where in outputs:
        datatype = oip.v2_datatype(arr)
        tensor = resp.outputs.add(name=out_name, datatype=datatype, shape=list(arr.shape))
        if isinstance(where, SharedRef):  # written to the region already
            for key, value in where.parameters().items():
                _set_parameter(tensor.parameters[key], value)
            # tritonclient finds an output's bytes by its place among the outputs
            resp.raw_output_contents.append(b"")
        else:
            resp.raw_output_contents.append(oip.tensor_bytes(arr))
    return resp


def _tensor_metadata(items: list[dict]) -> list:
    return [pb.ModelMetadataResponse.TensorMetadata(name=t["name"], datatype=t["datatype"],
                                                    shape=t["shape"]) for t in items]


# --------------------------------------------------------------------------------------------
# The service


def peer_host(context) -> str:
    """The client's address: "ipv4:127.0.0.1:51234" -> "127.0.0.1", "ipv6:[::1]:51234" ->
    "[::1]"."""
    return (context.peer() or "").partition(":")[2].rpartition(":")[0]


class Call(NamedTuple):
    """What a method's work gets: its deadline (loop time) and its admission (None: ungated)."""

    deadline: float
    ticket: Ticket | None


class Calls:
    """The gateway's rules around every gRPC call, as around an HTTP request: admission,
    deadline, metrics, and its failure as the call's status."""

    def __init__(self, gw: Gateway):
        self.gw = gw

    async def serve(self, method: str, context, work: Callable[[Call], Awaitable[Any]], *,
                    gated: bool = True, prediction: bool = False) -> Any:
        """``work(call)`` (see :meth:`call`), its refusal the call's status."""
        try:
            return await self.call(method, context, work, gated=gated, prediction=prediction)
        except ServingError as exc:
            if exc.status == 500:
                await context.abort(grpc.StatusCode.INTERNAL, str(exc))
            await self.abort(context, exc)

    async def call(self, method: str, context, work: Callable[[Call], Awaitable[Any]], *,
                   gated: bool = True, prediction: bool = False) -> Any:
        """``work(call)`` as the gateway serves an HTTP request: admitted (``gated``; a
        ``prediction`` takes a place at the predictor) from the moment the call reached this
        servicer (gRPC gives no earlier one), its deadline the gateway's or the client's,
        whichever comes first.  Every failure is raised as a :class:`ServingError` (status 500:
        a bug, logged)."""
        gw, metrics = self.gw, self.gw.metrics
        adm = gw.admission
        t0 = time.perf_counter()
        first = asyncio.get_running_loop().time()
        budget, remaining = adm.deadline(first), context.time_remaining()
        deadline = budget if remaining is None else min(budget, first + remaining)
        status, reason, ticket = 200, None, None
        metrics.inflight.inc()
        try:
            if gated:
                ticket = adm.admit(first, prediction)
                if type(ticket) is str:
                    reason, ticket = ticket, None
                    raise Overloaded(adm.messages[reason], reason=reason)
            return await work(Call(deadline, ticket))
        except asyncio.CancelledError:  # the client went away or its deadline passed
            status, reason = 499, "cancelled"
            raise
        except SensaiError as e:
            exc = e if isinstance(e, ServingError) else InputError(str(e))
            status, reason = exc.status, type(e).__name__
            count_error(gw, exc)
            raise exc from None
        except Exception as e:
            log.exception("gRPC %s failed", method)
            status, reason = 500, "internal"
            raise ServingError(f"internal error ({type(e).__name__}); see the server log",
                               status=500) from None
        finally:
            if ticket is not None:
                ticket.release()
            metrics.inflight.dec()
            route = SERVICE + method
            metrics.observe_request(route, "GRPC", str(status), time.perf_counter() - t0)
            if status >= 400:
                metrics.errors.labels(route, str(status), reason).inc()

    @staticmethod
    async def abort(context, exc: ServingError) -> None:
        trailer = []
        if exc.retry_after is not None:
            trailer.append(("retry-after", f"{max(1, round(exc.retry_after))}"))
        if exc.missing_classes:
            trailer.append(("missing-classes", json.dumps(exc.missing_classes)))
        if trailer:
            context.set_trailing_metadata(tuple(trailer))
        code = CODES.get(exc.status, grpc.StatusCode.INVALID_ARGUMENT if exc.status < 500
                         else grpc.StatusCode.UNAVAILABLE)
        await context.abort(code, str(exc))


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """The gateway's v2 routes as gRPC methods: admission, deadline, metrics and errors as HTTP
    has them (:class:`Calls`; ``ServerLive``/``ServerReady`` are never turned away, like
    ``/v2/health/*``)."""

    def __init__(self, gw: Gateway):
        self.gw = gw
        self.calls = Calls(gw)

    # -- health and metadata

    async def ServerLive(self, request, context):
        async def work(_):
            return pb.ServerLiveResponse(live=True)
        return await self.calls.serve("ServerLive", context, work, gated=False)

    async def ServerReady(self, request, context):
        async def work(_):
            return pb.ServerReadyResponse(ready=await asyncio.to_thread(server_ready, self.gw))
        return await self.calls.serve("ServerReady", context, work, gated=False)

    async def ModelReady(self, request, context):
        async def work(_):
            mv = self.gw.models.route(request.name, request.version or None)
            return pb.ModelReadyResponse(ready=await asyncio.to_thread(version_ready, mv))
        return await self.calls.serve("ModelReady", context, work, gated=False)

    async def ServerMetadata(self, request, context):
        async def work(_):
            return pb.ServerMetadataResponse(**v2_server_metadata(self.gw))
        return await self.calls.serve("ServerMetadata", context, work)

    async def ModelMetadata(self, request, context):
        async def work(_):
            m = v2_model_metadata(self.gw, self.gw.models.route(request.name,
                                                                request.version or None))
            return pb.ModelMetadataResponse(
                name=m["name"], versions=m["versions"], platform=m["platform"],
                inputs=_tensor_metadata(m["inputs"]), outputs=_tensor_metadata(m["outputs"]))
        return await self.calls.serve("ModelMetadata", context, work)

    async def ModelConfig(self, request, context):
        async def work(_):
            config = v2_model_config(self.gw, self.gw.models.route(request.name,
                                                                   request.version or None))
            return pb.ModelConfigResponse(
                config=json_format.ParseDict(config, model_config_pb2.ModelConfig()))
        return await self.calls.serve("ModelConfig", context, work)

    # -- inference

    def infer_work(self, request: pb.ModelInferRequest) -> Callable[[Call], Awaitable[Any]]:
        gw = self.gw

        async def work(call: Call) -> pb.ModelInferResponse:
            deadline = call.deadline
            name, version = request.model_name, request.model_version or None
            gw.models.route(name, version)  # an unknown model is told before its parsing
            clock = RequestClock()
            if typed_elements(request) <= INLINE_ELEMENTS:
                req = infer_request(request, gw.settings.max_body_bytes)
            else:
                async with gw.admission.slot(gw.admission.decoding, deadline, "request parsing"):
                    req = await asyncio.to_thread(infer_request, request,
                                                  gw.settings.max_body_bytes)
            async with gw.models.hold(name, version) as mv:
                pred, outputs = await v2_infer(gw, mv, req, deadline, f"gRPC {req.id or ''}",
                                               call.ticket, clock)
            response = infer_response(mv, request, pred, outputs)
            answered(gw, mv, len(pred.scores), pred, clock)
            return response
        return work

    async def ModelInfer(self, request, context):
        return await self.calls.serve("ModelInfer", context, self.infer_work(request),
                                      prediction=True)

    async def ModelStreamInfer(self, request_iterator, context):
        """Each request of the stream answered on it as it is done (its id says which); a
        request's failure is its answer's ``error_message``, and the stream goes on."""
        answers: asyncio.Queue = asyncio.Queue()

        async def one(msg: pb.ModelInferRequest) -> None:
            try:
                resp = await self.calls.call("ModelStreamInfer", context,
                                             self.infer_work(msg), prediction=True)
                await answers.put(pb.ModelStreamInferResponse(infer_response=resp))
            except ServingError as exc:
                await answers.put(pb.ModelStreamInferResponse(
                    error_message=str(exc), infer_response=pb.ModelInferResponse(
                        id=msg.id, model_name=msg.model_name,
                        model_version=msg.model_version)))

        async def read() -> None:
            tasks: set[asyncio.Task] = set()
            try:
                async for msg in request_iterator:
                    task = asyncio.create_task(one(msg))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
                await answers.put(None)

        reader = asyncio.create_task(read())
        try:
            while (answer := await answers.get()) is not None:
                yield answer
        finally:
            reader.cancel()

    async def ModelStatistics(self, request, context):
        async def work(_):
            # Where several gateway processes serve, the answer reads their files: off the loop.
            answer = await asyncio.to_thread(statistics, self.gw, request.name or None,
                                             request.version or None)
            for row in answer["model_stats"]:
                row.pop("class_parallel")  # gRPC's message has no field for it
            return json_format.ParseDict(answer, pb.ModelStatisticsResponse(),
                                         ignore_unknown_fields=True)
        return await self.calls.serve("ModelStatistics", context, work)

    # -- system shared memory (Triton's extension)

    async def SystemSharedMemoryStatus(self, request, context):
        async def work(_):
            regions = self.gw.shared_memory.status(request.name or None)
            return pb.SystemSharedMemoryStatusResponse(regions={
                r["name"]: pb.SystemSharedMemoryStatusResponse.RegionStatus(**r)
                for r in regions})
        return await self.calls.serve("SystemSharedMemoryStatus", context, work)

    async def SystemSharedMemoryRegister(self, request, context):
        async def work(_):
            self.gw.shared_memory.register(request.name, request.key, request.offset,
                                           request.byte_size, client=peer_host(context))
            return pb.SystemSharedMemoryRegisterResponse()
        return await self.calls.serve("SystemSharedMemoryRegister", context, work)

    async def SystemSharedMemoryUnregister(self, request, context):
        async def work(_):
            self.gw.shared_memory.unregister(request.name or None)
            return pb.SystemSharedMemoryUnregisterResponse()
        return await self.calls.serve("SystemSharedMemoryUnregister", context, work)

    # No CUDA region can be registered (CudaSharedMemoryRegister is UNIMPLEMENTED), so these
    # have nothing to list or let go: clients that clean up every kind of region (perf_analyzer
    # at its end) must not fail on them.
    async def CudaSharedMemoryStatus(self, request, context):
        async def work(_):
            if request.name:
                raise InputError(f"unknown CUDA shared memory region {request.name!r}")
            return pb.CudaSharedMemoryStatusResponse()
        return await self.calls.serve("CudaSharedMemoryStatus", context, work)

    async def CudaSharedMemoryUnregister(self, request, context):
        async def work(_):
            return pb.CudaSharedMemoryUnregisterResponse()
        return await self.calls.serve("CudaSharedMemoryUnregister", context, work)

    # -- the model repository (KServe v2 repository extension, as Triton's)

    def _check_access(self, context, changes: bool) -> None:
        auth = dict(context.invocation_metadata() or ()).get("authorization")
        check_access(self.gw.settings, client=peer_host(context), authorization=auth,
                     changes=changes)

    async def RepositoryIndex(self, request, context):
        async def work(_):
            self._check_access(context, changes=False)
            rows = self.gw.models.index(ready_only=request.ready)
            return pb.RepositoryIndexResponse(models=[
                pb.RepositoryIndexResponse.ModelIndex(**row) for row in rows])
        return await self.calls.serve("RepositoryIndex", context, work, gated=False)

    async def RepositoryModelLoad(self, request, context):
        async def work(_):
            self._check_access(context, changes=True)
            if request.parameters:
                raise InputError("load takes no parameters: a new version is a new folder in "
                                 "the repository")
            await self.gw.models.load(request.model_name)
            return pb.RepositoryModelLoadResponse()
        return await self.calls.serve("RepositoryModelLoad", context, work, gated=False)

    async def RepositoryModelUnload(self, request, context):
        async def work(_):
            self._check_access(context, changes=True)
            await self.gw.models.unload(request.model_name)
            return pb.RepositoryModelUnloadResponse()
        return await self.calls.serve("RepositoryModelUnload", context, work, gated=False)


def unimplemented(method: str):
    async def refuse(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            f"{method} is not implemented by sensai")
    return refuse


for _method in ("CudaSharedMemoryRegister", "TraceSetting", "LogSettings"):
    setattr(InferenceServicer, _method, unimplemented(_method))


class GrpcServer:
    """The service on ``host:port`` (0: the kernel's choice, then in :attr:`port`), on the running
    event loop.  Messages over the gateway's ``max_body_bytes`` are refused by gRPC itself."""

    def __init__(self, gw: Gateway):
        self.gw = gw
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None

    async def start(self, host: str, port: int, *, shared: bool = False) -> "GrpcServer":
        """``shared``: the port is shared with the other gateway processes of one server
        (SO_REUSEPORT), whose parent holds it."""
        limit = self.gw.settings.max_body_bytes
        # SO_REUSEPORT (gRPC's default on Linux) would let a second server share a busy port.
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                          ("grpc.so_reuseport", int(shared))])
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(self.gw), server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            bound = server.add_insecure_port(address)
        except RuntimeError as e:
            raise SensaiError(f"cannot serve gRPC on {address}: {e}") from None
        if not bound:
            raise SensaiError(f"cannot serve gRPC on {address} (is the port in use?)")
        await server.start()
        self.server, self.port = server, bound
        log.debug("serving KServe v2 over gRPC on %s:%d", host, bound)
        return self

    async def stop(self, grace_s: float = GRACE_S) -> None:
        """In-flight calls get ``grace_s`` to finish; new ones are refused at once."""
        if self.server is not None:
            await self.server.stop(grace_s)
            self.server = None
