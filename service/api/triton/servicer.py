"""TritonServicer: the KServe v2 `inference.GRPCInferenceService` (the stubs that ship in tritonclient) over the
service's backend, speaking the TensorRT-LLM ensemble contract.

Models (build_engine/triton_models/tables.py): `ensemble` (text, decoupled), `tensorrt_llm` (token ids,
decoupled), their non-decoupled twins `ensemble_sync` / `tensorrt_llm_sync` for unary ModelInfer, and the
ensemble's steps `preprocessing` / `postprocessing`, described (ModelReady, ModelMetadata, ModelConfig) for tools
that read every step, but not served.

Everything around the model is the llm.v1 edge's: the same backend, validation (SamplingParams, TextLimits, the
backend's admission), status codes (service/api/status.py), RPC slots (`--max-concurrent-rpcs`: one per
inference request), metrics, auth, TLS and drain. Handlers take raw bytes and parse them, so a malformed message
is INVALID_ARGUMENT (in a stream: an `error_message`, the stream stays open), as on the main port.

In a ModelStreamInfer stream each request runs as its own task and its responses are written as they come; a
stream cancelled by the client (tritonclient's `stop_stream(cancel_requests=True)`, a dropped connection) aborts
every request of the stream in the backend. The KServe request `id` is only echoed: requests are keyed by the
backend's own ids, and a `stop` request reaches only the requests of its own stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import numpy as np
from tritonclient.grpc import service_pb2
from tritonclient.grpc.service_pb2_grpc import GRPCInferenceServiceServicer

from build_engine.triton_models.configs import model_config
from build_engine.triton_models.tables import COUNT_OUTPUTS, MODEL_VERSION, MODELS, PERF_OUTPUTS, ModelSpec
from service.api.edge import Edge, Outcome, Slot
from service.api.interceptors import cache_salt
from service.api.metrics import ServiceMetrics
from service.api.status import status_for, unary_errors
from service.api.triton.convert import TritonCall, tensor_names, to_call
from service.api.triton.tensors import ResponseBuilder, decode_inputs
from service.api.validation import REQUEST_ID, TextLimits, encode_text
from service.backends.base import Backend
from service.errors import (
    EngineUnavailable,
    InvalidRequest,
    NotFound,
    ServerShutdown,
    Unsupported,
)
from service.request import GenerateRequest, RequestOutput

logger = logging.getLogger(__name__)

SERVICE_NAME = "inference.GRPCInferenceService"
EMPTY_FINAL = "triton_enable_empty_final_response"
MAX_ID_BYTES = 1024  # a KServe request id is echoed in every response: bound it
STREAM_BUFFER = 16  # responses waiting to be written per stream; beyond, its requests' deltas merge instead
EXTENSIONS = ("model_configuration", "binary_tensor_data", "parameters", "statistics")
DECOUPLED_INFER = "ModelInfer RPC doesn't support models with decoupled transaction policy"  # Triton's words
Response = service_pb2.ModelInferResponse | service_pb2.ModelStreamInferResponse  # unary | streamed


def model_metadata(spec: ModelSpec) -> service_pb2.ModelMetadataResponse:
    """ModelMetadata as Triton answers it: shapes with the batch dimension (-1) first."""
    meta = service_pb2.ModelMetadataResponse(name=spec.name, versions=[MODEL_VERSION], platform=spec.platform)
    for t in spec.served_inputs:
        meta.inputs.add(name=t.name, datatype=t.datatype, shape=[-1, *t.dims])
    for t in spec.outputs:
        if t.served:
            meta.outputs.add(name=t.name, datatype=t.datatype, shape=[-1, *t.dims])
    return meta


@dataclass(slots=True)
class _ModelStats:
    success: int = 0
    success_ns: int = 0
    fail: int = 0
    fail_ns: int = 0
    last_ms: int = 0


@dataclass(slots=True)
class _Progress:
    """What a request has sent so far (for its final status, and the last response of a stopped request)."""

    tokens: int = 0
    responder: _Responder | None = None


@dataclass(slots=True)
class _Stream:
    """The requests of one ModelStreamInfer call."""

    peer: str  # the client connection (its RPC slots' share)
    tasks: dict[asyncio.Task, str] = field(default_factory=dict)  # task -> its client id
    stopped: set[asyncio.Task] = field(default_factory=set)  # ended by a `stop` request


class _Responder:
    """One request's RequestOutput deltas -> its KServe responses (streamed, or one with everything)."""

    def __init__(self, call: TritonCall, prompt_ids: list[int], arrival_ns: int, unary: bool, empty_final: bool):
        self.call, self.prompt_ids, self.arrival_ns = call, prompt_ids, arrival_ns
        self.unary, self.empty_final = unary, empty_final
        self.ids: list[int] = []
        self.text: list[str] = []
        self.extras = bool(call.outputs & {*PERF_OUTPUTS, *COUNT_OUTPUTS})

    def delta(self, out: RequestOutput) -> Response | None:
        has = bool(out.new_token_ids or out.new_text)
        if self.call.stream:
            if not out.finished:
                return self._build(out.new_token_ids, out.new_text, None) if has else None
            if has or self.extras:
                return self._build(out.new_token_ids, out.new_text, out)
            return self.empty() if self.empty_final else None
        self.ids += out.new_token_ids
        self.text.append(out.new_text)
        if not out.finished:
            return None
        text, ids = "".join(self.text), self.ids
        if not self.call.exclude_input:  # TensorRT-LLM returns prompt + output unless asked not to
            text, ids = (self.call.text or "") + text, self.prompt_ids + ids
        return self._build(ids, text, out, count=len(self.ids))

    def stopped(self) -> Response:
        """The last response of a request ended by a `stop` request (as TensorRT-LLM: final, no new tokens)."""
        return self._build([], "", None, final=True)

    def empty(self) -> Response:
        return ResponseBuilder(self.call.model.name, MODEL_VERSION, self.call.client_id, stream=True).final(True)

    def _build(
        self, ids: list[int], text: str, out: RequestOutput | None, count: int | None = None, final: bool = False
    ) -> Response:
        want = self.call.outputs
        b = ResponseBuilder(self.call.model.name, MODEL_VERSION, self.call.client_id, stream=not self.unary)
        if "text_output" in want:
            b.add("text_output", "BYTES", np.array([[text.encode()]], dtype=np.object_))
        if "output_ids" in want:
            b.add("output_ids", "INT32", np.array(ids, dtype=np.int32).reshape(1, 1, len(ids)))
        if "sequence_length" in want:
            b.add("sequence_length", "INT32", np.array([[len(ids)]]))
        if "num_input_tokens" in want:
            b.add("num_input_tokens", "INT32", np.array([[len(self.prompt_ids)]]))
        if "num_output_tokens" in want:  # per response, as TensorRT-LLM counts it
            b.add("num_output_tokens", "INT32", np.array([[len(ids) if count is None else count]]))
        if out is not None and out.finished and out.timing is not None and PERF_OUTPUTS[0] in want:
            for name, value in zip(PERF_OUTPUTS, self._times(out), strict=True):
                b.add(name, "INT64", np.array([[value]]))
        if self.unary:
            return b.response
        return b.final(final or (out is not None and out.finished))

    def _times(self, out: RequestOutput) -> tuple[int, int, int, int]:
        """The engine's timing as steady-clock nanoseconds (time.monotonic_ns, like TensorRT-LLM's)."""
        t, arrival = out.timing, self.arrival_ns
        scheduled = arrival + round(t.queue_ms * 1e6)
        if not out.num_output_tokens:
            return arrival, scheduled, 0, 0
        first = arrival + round(t.ttft_ms * 1e6)
        return arrival, scheduled, first, first + round(t.decode_ms * 1e6)


class TritonServicer(GRPCInferenceServiceServicer):
    def __init__(self, edge: Edge, metrics: ServiceMetrics, max_requests_per_stream: int) -> None:
        self.edge = edge  # shared with the llm.v1 door: backend, RPC slots, drain flags, stall watch, tokenizer
        self.metrics = metrics
        self.max_requests_per_stream = max_requests_per_stream
        self.server_version = _version()
        self._stats = {name: _ModelStats() for name in MODELS}
        self._draining = asyncio.Event()

    def begin_drain(self) -> None:
        """The server drains: streams take no more requests and end once theirs have (idle ones at once)."""
        self._draining.set()

    # ---- registration --------------------------------------------------------------------------------------
    def generic_handler(self) -> grpc.GenericRpcHandler:
        """Every RPC of the service, taking raw request bytes (this class parses them)."""
        desc = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
        handlers = {}
        for method in desc.methods:
            serializer = getattr(service_pb2, method.output_type.name).SerializeToString
            mine = getattr(type(self), method.name) is not getattr(GRPCInferenceServiceServicer, method.name)
            fn = getattr(self, method.name) if mine else self._unimplemented(method.name)
            if method.client_streaming:
                handlers[method.name] = grpc.stream_stream_rpc_method_handler(fn, response_serializer=serializer)
            else:
                handlers[method.name] = grpc.unary_unary_rpc_method_handler(fn, response_serializer=serializer)
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

    @staticmethod
    def _unimplemented(name: str):
        async def handler(raw: bytes, context: grpc.aio.ServicerContext):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not supported by this server")

        return handler

    # ---- helpers -------------------------------------------------------------------------------------------
    def _backend_or_none(self) -> Backend | None:
        try:
            return self.edge.ready()
        except EngineUnavailable:
            return None

    def _ready(self) -> bool:
        backend = self._backend_or_none()
        return backend is not None and backend.is_healthy

    @staticmethod
    def _model(name: str, version: str = "") -> ModelSpec:
        spec = MODELS.get(name)
        if spec is None:
            raise NotFound(f"Request for unknown model: '{name}' is not found")
        if version not in ("", MODEL_VERSION):
            raise NotFound(f"Request for unknown model: '{name}' version {version} is not found")
        return spec

    def _finished(self, model: str, code: grpc.StatusCode, started_ns: int) -> None:
        known = model if model in self._stats else "(unknown)"
        self.metrics.triton_request_finished(known, code.name)
        stats = self._stats.get(model)
        if stats is None:
            return
        elapsed = time.monotonic_ns() - started_ns
        stats.last_ms = int(time.time() * 1000)
        if code == grpc.StatusCode.OK:
            stats.success, stats.success_ns = stats.success + 1, stats.success_ns + elapsed
        else:
            stats.fail, stats.fail_ns = stats.fail + 1, stats.fail_ns + elapsed

    # ---- health and metadata (unary: errors mapped by status.unary_errors) ---------------------------------------
    @unary_errors
    async def ServerLive(self, raw: bytes, context: grpc.aio.ServicerContext) -> service_pb2.ServerLiveResponse:
        self.edge.parse(service_pb2.ServerLiveRequest, raw)  # the health checks take no RPC slot
        return service_pb2.ServerLiveResponse(live=True)

    @unary_errors
    async def ServerReady(self, raw: bytes, context: grpc.aio.ServicerContext) -> service_pb2.ServerReadyResponse:
        self.edge.parse(service_pb2.ServerReadyRequest, raw)
        return service_pb2.ServerReadyResponse(ready=self._ready())

    @unary_errors
    async def ModelReady(self, raw: bytes, context: grpc.aio.ServicerContext) -> service_pb2.ModelReadyResponse:
        req = self.edge.parse(service_pb2.ModelReadyRequest, raw)
        known = req.name in MODELS and req.version in ("", MODEL_VERSION)
        return service_pb2.ModelReadyResponse(ready=known and self._ready())

    @unary_errors
    async def ServerMetadata(self, raw: bytes, context: grpc.aio.ServicerContext) -> service_pb2.ServerMetadataResponse:
        with self.edge.slot(context.peer()):
            self.edge.parse(service_pb2.ServerMetadataRequest, raw)
            return service_pb2.ServerMetadataResponse(
                name="llm-grpc-serving", version=self.server_version, extensions=list(EXTENSIONS)
            )

    @unary_errors
    async def ModelMetadata(self, raw: bytes, context: grpc.aio.ServicerContext) -> service_pb2.ModelMetadataResponse:
        with self.edge.slot(context.peer()):
            req = self.edge.parse(service_pb2.ModelMetadataRequest, raw)
            return model_metadata(self._model(req.name, req.version))

    @unary_errors
    async def ModelConfig(self, raw: bytes, context: grpc.aio.ServicerContext) -> service_pb2.ModelConfigResponse:
        with self.edge.slot(context.peer()):
            req = self.edge.parse(service_pb2.ModelConfigRequest, raw)
            spec = self._model(req.name, req.version)
            return service_pb2.ModelConfigResponse(config=model_config(spec, 1, self._parameters(spec)))

    def _parameters(self, spec: ModelSpec) -> dict[str, str]:
        """What the backend is, for the tensorrt_llm model's config (TensorRT-LLM's parameter names)."""
        backend = self._backend_or_none()
        if spec.kind != "tensorrt_llm" or backend is None:
            return {}
        i = backend.info
        return {
            "gpt_model_type": "inflight_fused_batching",
            "max_beam_width": "1",
            "enable_kv_cache_reuse": str(i.prefix_caching).lower(),
            "enable_chunked_context": "true",
            "max_tokens_in_paged_kv_cache": str(i.num_kv_blocks * i.kv_block_size),
            "exclude_input_in_output": "false",
            "llm_backend": i.backend,  # ours: the backend behind the front door (native, trtllm, triton)
            "llm_model_name": i.model_name,
            "llm_max_seq_len": str(i.max_seq_len),
            "llm_max_batch_size": str(i.max_batch_size),
        }

    @unary_errors
    async def ModelStatistics(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> service_pb2.ModelStatisticsResponse:
        with self.edge.slot(context.peer()):
            req = self.edge.parse(service_pb2.ModelStatisticsRequest, raw)
            names = [self._model(req.name, req.version).name] if req.name else list(MODELS)
            resp = service_pb2.ModelStatisticsResponse()
            for name in names:
                s = self._stats[name]
                m = resp.model_stats.add(
                    name=name,
                    version=MODEL_VERSION,
                    last_inference=s.last_ms,
                    inference_count=s.success,
                    execution_count=s.success,
                )
                m.inference_stats.success.count, m.inference_stats.success.ns = s.success, s.success_ns
                m.inference_stats.fail.count, m.inference_stats.fail.ns = s.fail, s.fail_ns
            return resp

    @unary_errors
    async def RepositoryIndex(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> service_pb2.RepositoryIndexResponse:
        with self.edge.slot(context.peer()):
            self.edge.parse(service_pb2.RepositoryIndexRequest, raw)
            state = "READY" if self._ready() else "UNAVAILABLE"
            resp = service_pb2.RepositoryIndexResponse()
            for name in MODELS:
                resp.models.add(name=name, version=MODEL_VERSION, state=state)
            return resp

    # ---- inference ---------------------------------------------------------------------------------------------
    async def _prepare(self, req: service_pb2.ModelInferRequest) -> tuple[TritonCall, Backend, bool]:
        """Model, readiness, tensors and values checked: the call, its backend, and whether an empty final
        response was asked for."""
        spec = self._model(req.model_name, req.model_version)
        if not spec.infers:
            raise Unsupported(
                f"model '{spec.name}' is a step of 'ensemble', described for tools that read every step; send "
                f"inference requests to 'ensemble' or 'tensorrt_llm'"
            )
        backend = self.edge.ready()
        if len(req.id.encode()) > MAX_ID_BYTES:
            raise InvalidRequest(f"the request id is longer than {MAX_ID_BYTES} bytes")
        empty_final = False
        if EMPTY_FINAL in req.parameters:
            param = req.parameters[EMPTY_FINAL]
            if param.WhichOneof("parameter_choice") != "bool_param":
                raise InvalidRequest(f"invalid value type for '{EMPTY_FINAL}' parameter, expected bool_param.")
            empty_final = param.bool_param
        tensors = decode_inputs(spec, req)
        call = to_call(spec, req.id, tensors, [o.name for o in req.outputs], backend.info)
        return call, backend, empty_final

    async def _prompt_ids(self, call: TritonCall, backend: Backend, peer: str) -> list[int]:
        if call.prompt_ids is not None:
            return call.prompt_ids  # checked against the vocabulary once, by the backend on admission
        backend.check_capacity()  # do not tokenize what the queue would refuse anyway
        limits = TextLimits.for_model(backend.tokenizer, backend.info.max_seq_len)
        limits.check(len(call.text.encode()), "text_input")
        return await self.edge.tokenize(
            peer, len(call.text.encode()), limits,
            encode_text, backend.tokenizer, call.text, "text_input", True, call.sampling.max_tokens,
            backend.info.max_seq_len,
        )  # fmt: skip

    async def _run(
        self, call: TritonCall, backend: Backend, unary: bool, empty_final: bool, progress: _Progress, slot: Slot
    ) -> AsyncIterator[Response]:
        """Generate, yielding the responses (closing this generator aborts the request in the backend); the
        slot is released as soon as the backend's work ends, whether or not the responses were written."""
        ids = await self._prompt_ids(call, backend, slot.peer)
        request_id = call.client_id if REQUEST_ID.fullmatch(call.client_id) else f"triton-{uuid.uuid4().hex}"
        gen = GenerateRequest(request_id, ids, call.sampling, cache_salt=cache_salt())  # the tenant's, if any
        progress.responder = responder = _Responder(call, ids, time.monotonic_ns(), unary, empty_final)
        try:
            async with contextlib.aclosing(backend.generate(gen, on_done=slot.release)) as outputs:
                async for out in outputs:
                    if out.finished and out.finish_reason == "abort":
                        raise ServerShutdown("the server shut down before the request finished")
                    progress.tokens += len(out.new_token_ids)
                    resp = responder.delta(out)
                    if resp is not None:
                        yield resp
        except InvalidRequest as exc:  # admission's messages name llm.v1 fields: use the tensors' names
            raise InvalidRequest(tensor_names(str(exc), call.model)) from None

    async def ModelInfer(self, raw: bytes, context: grpc.aio.ServicerContext) -> service_pb2.ModelInferResponse:
        started, progress = time.monotonic_ns(), _Progress()

        def done(call: Outcome) -> None:
            self._finished(call.label, call.code, started)

        async with self.edge.outcome(context, done) as call:
            with self.edge.slot(context.peer()) as slot:
                req = self.edge.parse(service_pb2.ModelInferRequest, raw)
                call.label, call.request_id = req.model_name, req.id or None
                if self._model(req.model_name, req.model_version).decoupled:
                    raise Unsupported(DECOUPLED_INFER)
                request, backend, _ = await self._prepare(req)
                if request.stop:  # nothing to stop: a unary request has no stream its id could name
                    return ResponseBuilder(request.model.name, MODEL_VERSION, request.client_id, stream=False).response
                result = None
                responses = self._run(request, backend, True, False, progress, slot)
                async with contextlib.aclosing(responses):
                    async for resp in responses:
                        result = resp  # one, at the end: a unary client has seen no output before (UNAVAILABLE)
                return result

    async def ModelStreamInfer(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
        queue: asyncio.Queue = asyncio.Queue(STREAM_BUFFER)
        stream = _Stream(peer=context.peer())

        # requests of this stream in flight at most (beyond, the reader waits and gRPC's flow control holds the
        # client back): a client that sends without reading cannot pile up tasks
        room = asyncio.Semaphore(self.max_requests_per_stream)

        def done(task: asyncio.Task) -> None:
            stream.tasks.pop(task, None)
            stream.stopped.discard(task)
            room.release()

        async def read() -> None:
            try:
                async for raw in requests:
                    await room.acquire()
                    task = asyncio.ensure_future(self._stream_one(raw, queue, stream))
                    stream.tasks[task] = ""
                    task.add_done_callback(done)
            except Exception:  # the request stream broke (client gone): the handler is ending too
                logger.debug("ModelStreamInfer request stream ended with an error", exc_info=True)

        async def supervise() -> None:
            """End the stream once the client has closed its side (or the server drains) and its requests ended."""
            reading = asyncio.ensure_future(read())
            draining = asyncio.ensure_future(self._draining.wait())
            try:
                await asyncio.wait({reading, draining}, return_when=asyncio.FIRST_COMPLETED)
                if not reading.done():  # draining: take no more requests; an idle stream ends now
                    reading.cancel()
                await asyncio.gather(reading, return_exceptions=True)
                await asyncio.gather(*list(stream.tasks), return_exceptions=True)
                await queue.put(None)
            finally:
                reading.cancel()
                draining.cancel()

        reader = asyncio.ensure_future(supervise())
        try:
            with self.edge.watch_writes(context) as writes:
                # a stalled reader: stop taking requests, abort those in flight (their tasks' cleanup does)
                writes.on_stall = lambda: [task.cancel() for task in (reader, *stream.tasks)]
                while True:
                    item = await queue.get()
                    if item is None:
                        return
                    writes.pending()  # a client that stops reading leaves this pending: the edge ends the stream
                    yield item
                    writes.sent()
        finally:  # normal end, the client cancelled / went away, or stalled: abort whatever still runs
            reader.cancel()
            tasks = list(stream.tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    async def _stream_one(self, raw: bytes, queue: asyncio.Queue, stream: _Stream) -> None:
        """One request of a stream: its responses, or one error_message, onto the stream's queue."""
        started, model, client_id, code = time.monotonic_ns(), "", "", grpc.StatusCode.OK
        me = asyncio.current_task()
        progress = _Progress()
        try:
            with self.edge.slot(stream.peer) as slot:
                req = self.edge.parse(service_pb2.ModelInferRequest, raw)
                model, client_id = req.model_name, req.id
                call, backend, empty_final = await self._prepare(req)
                stream.tasks[me] = client_id
                if call.stop:
                    self._stop(stream, me, client_id)
                    if empty_final:
                        await queue.put(_empty(call))
                    return
                responses = self._run(call, backend, False, empty_final, progress, slot)
                async with contextlib.aclosing(responses):
                    async for resp in responses:
                        await queue.put(resp)  # waits while the stream's buffer is full: the backend merges
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            if me not in stream.stopped:  # the stream itself was cancelled: nothing more can be written
                raise
            if hasattr(me, "uncancel"):  # ended by a `stop` request of this stream, not by the stream's end
                me.uncancel()
            if progress.responder is not None:  # TensorRT-LLM sends a final response for a stopped request
                await queue.put(progress.responder.stopped())
        except Exception as exc:
            code, message = status_for(exc, client_id or None, progress.tokens)
            await queue.put(_error(message, model, client_id))
        finally:
            self._finished(model, code, started)

    @staticmethod
    def _stop(stream: _Stream, me: asyncio.Task, client_id: str) -> None:
        """A `stop` request ends the requests with the same id on the same stream (never another stream's)."""
        for task, other_id in list(stream.tasks.items()):
            if task is not me and other_id == client_id and not task.done():
                stream.stopped.add(task)
                task.cancel()


def _version() -> str:
    try:
        return importlib.metadata.version("llm-grpc-serving")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _empty(call: TritonCall) -> service_pb2.ModelStreamInferResponse:
    return ResponseBuilder(call.model.name, MODEL_VERSION, call.client_id, stream=True).final(True)


def _error(message: str, model: str, client_id: str) -> service_pb2.ModelStreamInferResponse:
    resp = service_pb2.ModelStreamInferResponse(error_message=message)
    resp.infer_response.model_name, resp.infer_response.id = model, client_id
    resp.infer_response.parameters["triton_final_response"].bool_param = True
    return resp
