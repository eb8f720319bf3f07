"""The Triton front door's inference: ModelInfer (unary, the non-decoupled models) and ModelStreamInfer (the
decoupled ones), over the shared edge and the service's backend.

In a ModelStreamInfer stream each request runs as its own task and its responses are written as they come; a
stream cancelled by the client (tritonclient's `stop_stream(cancel_requests=True)`, a dropped connection) aborts
every request of the stream in the backend. The KServe request `id` is only echoed: requests are keyed by the
backend's own ids, and a `stop` request reaches only the requests of its own stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from tritonclient.grpc import service_pb2

from build_engine.triton_models.tables import MODEL_VERSION
from service.api.edge import Edge, Outcome, Slot
from service.api.interceptors import cache_salt
from service.api.metrics import ServiceMetrics
from service.api.status import status_for
from service.api.triton.convert import TritonCall, tensor_names, to_call
from service.api.triton.metadata import Models, Statistics
from service.api.triton.responses import Responder, Response, empty, error
from service.api.triton.steps import Steps
from service.api.triton.tensors import ResponseBuilder, decode_inputs
from service.api.validation import REQUEST_ID, TextLimits, encode_text
from service.backends.base import Backend
from service.errors import InvalidRequest, ServerShutdown, StreamStalled, Unsupported
from service.request import GenerateRequest

logger = logging.getLogger(__name__)

EMPTY_FINAL = "triton_enable_empty_final_response"
MAX_ID_BYTES = 1024  # a KServe request id is echoed in every response: bound it
STREAM_BUFFER = 16  # responses waiting to be written per stream; beyond, its requests' deltas merge instead
STEP_KINDS = ("preprocessing", "postprocessing")
DECOUPLED_INFER = "ModelInfer RPC doesn't support models with decoupled transaction policy"  # Triton's words


@dataclass(slots=True)
class _Progress:
    """What a request has sent so far (for its final status, and the last response of a stopped request)."""

    tokens: int = 0
    responder: Responder | None = None


@dataclass(slots=True)
class _Stream:
    """The requests of one ModelStreamInfer call."""

    peer: str  # the client connection (its RPC slots' share)
    tasks: dict[asyncio.Task, str] = field(default_factory=dict)  # task -> its client id
    stopped: set[asyncio.Task] = field(default_factory=set)  # ended by a `stop` request


class TritonInference:
    def __init__(
        self, edge: Edge, metrics: ServiceMetrics, statistics: Statistics, max_requests_per_stream: int,
        models: Models, steps: Steps,
    ) -> None:  # fmt: skip
        self.edge = edge
        self.models = models
        self.steps = steps
        self.metrics = metrics
        self.statistics = statistics
        self.max_requests_per_stream = max_requests_per_stream
        self._draining = asyncio.Event()

    def begin_drain(self) -> None:
        """The server drains: streams take no more requests and end once theirs have (idle ones at once)."""
        self._draining.set()

    def _finished(self, model: str, code: grpc.StatusCode, started_ns: int) -> None:
        self.metrics.triton_request_finished(model if model in self.models.specs else "(unknown)", code.name)
        self.statistics.record(model, code, started_ns)

    # ---- inference ---------------------------------------------------------------------------------------------
    async def _prepare(self, req: service_pb2.ModelInferRequest) -> tuple[TritonCall, Backend, bool]:
        """Model, readiness, tensors and values checked: the call, its backend, and whether an empty final
        response was asked for."""
        spec = self.models.find(req.model_name, req.model_version)
        backend = self.edge.admit()
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
        progress.responder = responder = Responder(
            call, ids, time.monotonic_ns(), unary, empty_final, backend.info.kv_block_size, self._decoder(backend)
        )
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

    async def _step(self, req: service_pb2.ModelInferRequest, peer: str, stream: bool) -> Response | None:
        """The response of a request to a step model (preprocessing, postprocessing: steps.py), or None for the
        LLM models, which the caller runs."""
        spec = self.models.find(req.model_name, req.model_version)
        if spec.kind not in STEP_KINDS:
            return None
        return await self.steps.infer(spec, req, self.edge.admit(), peer, stream=stream)

    @staticmethod
    def _decoder(backend: Backend):
        """ids -> text as the ensemble's postprocessing step decodes them (special tokens skipped)."""
        return lambda ids: backend.tokenizer.decode(ids, skip_special_tokens=True)

    async def ModelInfer(self, raw: bytes, context: grpc.aio.ServicerContext) -> service_pb2.ModelInferResponse:
        started, progress = time.monotonic_ns(), _Progress()

        def done(call: Outcome) -> None:
            self._finished(call.label, call.code, started)

        async with self.edge.outcome(context, done) as call:
            with self.edge.slot(context.peer()) as slot:
                req = self.edge.parse(service_pb2.ModelInferRequest, raw)
                call.label, call.request_id = req.model_name, req.id or None
                if self.models.find(req.model_name, req.model_version).decoupled:
                    raise Unsupported(DECOUPLED_INFER)
                step = await self._step(req, slot.peer, stream=False)
                if step is not None:
                    return step
                request, backend, _ = await self._prepare(req)
                if request.stop:  # nothing to stop: a unary request has no stream its id could name
                    return ResponseBuilder(request.model.name, MODEL_VERSION, request.client_id, stream=False).response
                result = None
                responses = self._run(request, backend, True, False, progress, slot)
                async with contextlib.aclosing(responses):
                    async for resp in responses:
                        result = resp  # one, at the end: a unary client has seen no output before (UNAVAILABLE)
                return result

    async def infer_stream(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
        """One inference request of any model, its responses yielded as they come, for a transport that gives each
        request a stream of its own (the HTTP door's generate and generate_stream; `context` needs only peer,
        time_remaining and abort). The same checks, slot, statistics and stall watch as a ModelStreamInfer
        request, but an error ends the call (context.abort, as in ModelInfer) instead of becoming an
        error_message, and a reader that stalls has the task iterating this cancelled."""
        started, progress = time.monotonic_ns(), _Progress()

        def done(call: Outcome) -> None:
            self._finished(call.label, call.code, started)

        async with self.edge.outcome(context, done) as call:
            with self.edge.slot(context.peer()) as slot, self.edge.watch_writes(context) as writes:
                call.writes = writes
                writes.on_stall = asyncio.current_task().cancel  # the consumer waits in its write: end it there
                req = self.edge.parse(service_pb2.ModelInferRequest, raw)
                call.label, call.request_id = req.model_name, req.id or None
                step = await self._step(req, slot.peer, stream=True)
                if step is not None:
                    yield step
                    return
                request, backend, empty_final = await self._prepare(req)
                if request.stop:  # a stream of one request holds nothing a stop could name
                    yield empty(request)
                    return
                responses = self._run(request, backend, False, empty_final, progress, slot)
                async with contextlib.aclosing(responses):
                    async for resp in responses:
                        call.tokens = progress.tokens
                        writes.pending()
                        yield resp
                        writes.sent()

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
                    writes.sent()  # StreamStalled once the edge has ended it
        except StreamStalled as exc:
            await context.abort(grpc.StatusCode.ABORTED, str(exc))
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
                step = await self._step(req, stream.peer, stream=True)
                if step is not None:
                    await queue.put(step)
                    return
                call, backend, empty_final = await self._prepare(req)
                stream.tasks[me] = client_id
                if call.stop:
                    self._stop(stream, me, client_id)
                    if empty_final:
                        await queue.put(empty(call))
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
            await queue.put(error(message, model, client_id))
        finally:
            self._finished(model, code, started)

    @staticmethod
    def _stop(stream: _Stream, me: asyncio.Task, client_id: str) -> None:
        """A `stop` request ends the requests with the same id on the same stream (never another stream's)."""
        for task, other_id in list(stream.tasks.items()):
            if task is not me and other_id == client_id and not task.done():
                stream.stopped.add(task)
                task.cancel()
