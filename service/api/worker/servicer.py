"""TrtllmServicer: TensorRT-LLM's gRPC worker protocol (`trtllm.TrtllmService`, as `trtllm-serve --grpc` serves
it), so a gateway that drives TensorRT-LLM workers (the Shepherd Model Gateway, smg) drives this server.

Conversion and streaming only: the field mappings are convert.py's, everything shared (slots, drain, parsing,
the stall watch, the final status) the edge's. Handlers receive raw request bytes (see server.py), so a
malformed message is INVALID_ARGUMENT naming the field. Until the backend has warmed up, and while draining,
every RPC of this service, HealthCheck included, answers UNAVAILABLE; on a backend that streams text without
token ids (the triton backend over an ensemble), UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
from smg_grpc_proto import trtllm_service_pb2 as pb
from smg_grpc_proto.generated import common_pb2

from service import PACKAGE, version
from service.api import interceptors
from service.api.edge import Edge
from service.api.metrics import ServiceMetrics
from service.api.status import unary_errors
from service.api.worker import bundle, convert, kv_stream
from service.backends.base import Backend
from service.errors import DeadlineExceeded, EngineUnavailable, InvalidRequest, ServerShutdown, Unsupported
from service.limits import check_constraint
from service.request import RequestOutput, TokenLogprob

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TrtllmService"].full_name
TEXT_ONLY = "chunk.token_ids"  # BackendInfo.not_reported of a backend that streams no token ids


class _Reply:
    """One Generate's replies: the ids so far, and the stop token left out unless the client asked for it."""

    def __init__(self, req: pb.GenerateRequest) -> None:
        self.request_id = req.request_id
        self.streaming = req.streaming
        self.keep_stop_token = req.include_stop_token_in_output
        self.perf = req.output_config.return_perf_metrics
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.last_token: int | None = None  # the last generated, even when left out (an EOS's matched_token_id)

    def add(self, out: RequestOutput) -> Iterator[pb.GenerateResponse]:
        ids, lps = list(out.new_token_ids), list(out.logprobs or ())
        if ids:
            self.last_token = ids[-1]
        if ids and convert.ends_on_token(out) and not self.keep_stop_token:
            ids, lps = ids[:-1], lps[: len(ids) - 1]
        self.ids += ids
        self.logprobs += lps
        if self.streaming and ids:
            yield convert.chunk(self.request_id, ids, lps, out)
        if out.finished:
            yield convert.complete(self.request_id, out, self.ids, self.logprobs, self.last_token, self.perf)


class TrtllmServicer:
    def __init__(self, edge: Edge, metrics: ServiceMetrics, engine_dir: str | Path) -> None:
        self.edge = edge
        self.metrics = metrics
        self.engine_dir = engine_dir
        self._running: dict[str, asyncio.Event] = {}  # request id -> set by Abort
        self._bundle: bundle.Bundle | None = None

    def generic_handler(self) -> grpc.GenericRpcHandler:
        """Every RPC of the service (the descriptor's list: a method a newer proto adds fails here), taking raw
        request bytes."""
        handlers = {}
        for method in pb.DESCRIPTOR.services_by_name["TrtllmService"].methods:
            reply = method.output_type._concrete_class.SerializeToString
            fn = getattr(self, method.name)
            if method.server_streaming:
                handlers[method.name] = grpc.unary_stream_rpc_method_handler(fn, response_serializer=reply)
            else:
                handlers[method.name] = grpc.unary_unary_rpc_method_handler(fn, response_serializer=reply)
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

    def _serving(self) -> Backend:
        backend = self.edge.admit()  # UNAVAILABLE while loading or warming up, or after the drain cut streams
        if TEXT_ONLY in backend.info.not_reported:  # every RPC, HealthCheck too: a gateway must not register it
            raise Unsupported(
                "this server's backend returns text, not token ids (a Triton ensemble), and the worker protocol "
                "streams ids: serve Triton's tensorrt_llm model (--triton-model tensorrt_llm) to use it"
            )
        if not backend.is_healthy:
            raise EngineUnavailable("the engine is not healthy")
        return backend

    @contextlib.contextmanager
    def _registered(self, request_id: str) -> Iterator[asyncio.Event]:
        """The event an Abort of this request id sets, while the block runs."""
        if request_id in self._running:
            raise InvalidRequest(f"request_id {request_id!r} is already in flight")
        self._running[request_id] = aborted = asyncio.Event()
        try:
            yield aborted
        finally:
            del self._running[request_id]

    async def Generate(self, raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        peer = context.peer()
        async with self.edge.outcome(context, lambda call: self.metrics.rpc_finished(call.code.name)) as call:
            with self.edge.slot(peer) as slot, self.edge.watch_writes(context) as writes:
                call.writes = writes
                backend = self._serving()
                req = self.edge.parse(pb.GenerateRequest, raw)
                salt = interceptors.cache_salt(convert.client_salt(req))
                gen = convert.to_domain(req, backend.info.vocab_size, salt)
                try:
                    check_constraint(gen.sampling, backend.info.constraint_kinds, backend.info.backend)
                except InvalidRequest as exc:
                    raise InvalidRequest(convert.proto_names(str(exc))) from None
                call.request_id = gen.request_id
                if call.past_deadline():
                    raise DeadlineExceeded("the deadline had passed before the request was queued")
                reply = _Reply(req)
                with self._registered(gen.request_id) as aborted:
                    # the slot ends with the request's work; closing `outputs` (a cancel, an Abort) aborts it
                    try:
                        stream = backend.generate(gen, on_done=slot.release)
                    except InvalidRequest as exc:  # the backend's own refusal names llm.v1's fields
                        raise InvalidRequest(convert.proto_names(str(exc))) from None
                    async with (
                        contextlib.aclosing(stream) as outputs,
                        contextlib.aclosing(_until(outputs, aborted)) as steps,
                    ):
                        writes.on_stall = lambda: _spawn(outputs.aclose())
                        try:
                            async for out in steps:
                                call.tokens += len(out.new_token_ids)
                                if out.finished and out.finish_reason == "abort" and self.edge.cut:
                                    raise ServerShutdown("the server shut down before the request finished")
                                for msg in reply.add(out):
                                    writes.pending()
                                    yield msg
                                    writes.sent()
                        except InvalidRequest as exc:  # a constraint that does not compile (before any output)
                            raise InvalidRequest(convert.proto_names(str(exc))) from None

    @unary_errors
    async def Abort(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        """Cancel the request's Generate as if its client had gone: the engine aborts it and frees its blocks."""
        self._serving()
        req = self.edge.parse(pb.AbortRequest, raw)
        aborted = self._running.get(req.request_id)
        if aborted is None:
            return pb.AbortResponse(success=False, message=f"no request {req.request_id!r} in flight")
        aborted.set()
        return pb.AbortResponse(success=True, message=f"request {req.request_id!r} aborted")

    @unary_errors
    async def HealthCheck(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.HealthCheckResponse:
        self.edge.parse(pb.HealthCheckRequest, raw)
        self._serving()
        return pb.HealthCheckResponse(status="OK")

    @unary_errors
    async def GetModelInfo(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        backend = self._serving()
        self.edge.parse(pb.GetModelInfoRequest, raw)
        i = backend.info
        return pb.GetModelInfoResponse(
            model_id=i.model_name,
            max_input_len=i.max_seq_len - 1,  # at least one token is generated
            max_seq_len=i.max_seq_len,
            max_batch_size=i.max_batch_size,
            vocab_size=i.vocab_size,
            hidden_size=i.hidden_size,
            num_layers=i.num_layers,
            num_heads=i.num_attention_heads,
            supported_features=supported_features(backend),
        )

    @unary_errors
    async def GetServerInfo(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.GetServerInfoResponse:
        backend = self._serving()
        self.edge.parse(pb.GetServerInfoRequest, raw)
        return pb.GetServerInfoResponse(
            version=f"{PACKAGE} {version()}",
            backend=backend.info.backend,
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            context_parallel_size=1,
            world_size=1,
        )

    async def GetTokenizer(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        """The Hugging Face-format tokenizer bundle (bundle.py): the zip in chunks, its sha256 on the last."""
        async with self.edge.outcome(context, lambda call: None):
            backend = self._serving()
            self.edge.parse(common_pb2.GetTokenizerRequest, raw)
            if self._bundle is None:
                loop = asyncio.get_running_loop()
                self._bundle = await loop.run_in_executor(
                    None, bundle.build, self.engine_dir, backend.info, backend.tokenizer
                )
            pieces = self._bundle.chunks()
            for n, piece in enumerate(pieces, 1):
                yield common_pb2.GetTokenizerChunk(data=piece, sha256=self._bundle.sha256 if n == len(pieces) else "")

    @unary_errors
    async def Embed(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        self._serving()
        raise Unsupported("Embed is not supported: this server serves generative models only")

    async def SubscribeKvEvents(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        """The prefix cache's KV events and the engine's load (kv_stream.py); UNIMPLEMENTED where the backend
        publishes none (the triton backend, --kv-event-history 0, no prefix caching), so a gateway stops asking.
        Holds an RPC slot for its life (a gateway keeps one open per worker), so subscriptions count against
        --max-concurrent-rpcs and the per-connection share like any other stream; it ends when draining starts."""
        async with self.edge.outcome(context, lambda call: None):
            backend = self._serving()
            with self.edge.slot(context.peer()):  # RESOURCE_EXHAUSTED past the limits
                req = self.edge.parse(common_pb2.SubscribeKvEventsRequest, raw)
                log = backend.kv_events
                if log is None:
                    off = (
                        "prefix caching is off" if not backend.info.prefix_caching else "they are off or not available"
                    )
                    raise Unsupported(f"this worker publishes no KV events ({off}): route without them")
                kv_stream.check_cursor(log, req)  # OUT_OF_RANGE as the call's status, before any reply
                await context.send_initial_metadata(())  # the call completes now, not at the first batch
                loads = kv_stream.LoadRecords(backend, self.metrics.generated_tokens)
                stream = kv_stream.subscribe(log, req, loads, lambda: self.edge.draining)
                async with contextlib.aclosing(stream) as batches:
                    async for batch in batches:
                        yield batch


def supported_features(backend: Backend) -> list[str]:
    """What GetModelInfo lists: the protocol's optional features this server honours (convert.HONOURED)."""
    features = ["streaming", "logprobs", "seed", "min_p", "penalties", "stop", "stop_token_ids", "ignore_eos"]
    features += ["cache_salt", "perf_metrics", "tokenizer_bundle", "abort"]
    if backend.info.prefix_caching:
        features.append("prefix_caching")
    if backend.kv_events is not None:
        features.append("kv_events")
    return features


async def _until(outputs: AsyncIterator[RequestOutput], aborted: asyncio.Event) -> AsyncIterator[RequestOutput]:
    """The request's outputs until it ends or `aborted` is set: then the wait for the next output is cancelled,
    which aborts the request in the backend (its stream's cancel path), and a last output says "abort"."""
    abort = asyncio.ensure_future(aborted.wait())
    step: asyncio.Future | None = None
    last = RequestOutput(request_id="", new_token_ids=[])
    try:
        while True:
            step = asyncio.ensure_future(anext(outputs))
            await asyncio.wait((step, abort), return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                await _cancel(step)
                yield dataclasses.replace(last, new_token_ids=[], logprobs=None, finished=True, finish_reason="abort")
                return
            try:
                last = step.result()
            except StopAsyncIteration:
                return
            yield last
    finally:
        abort.cancel()
        if step is not None and not step.done():  # this handler was cancelled (its client went away)
            await _cancel(step)


async def _cancel(step: asyncio.Future) -> None:
    step.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await step


_BACKGROUND: set[asyncio.Task] = set()


def _spawn(coro) -> None:
    """Run a coroutine in the background, keeping a reference until it is done."""
    task = asyncio.ensure_future(coro)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
