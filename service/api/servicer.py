"""LLMServicer: protobuf <-> domain conversion and streaming; nothing else.

Handlers receive the raw request bytes (see server.py) so that a malformed message is INVALID_ARGUMENT
naming the field, instead of grpc.aio's UNKNOWN carrying the parser's exception text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from protos.llm.v1 import llm_pb2
from service.api import interceptors, validation
from service.api.metrics import ServiceMetrics
from service.api.status import status_for, unary_errors
from service.api.validation import TextLimits, chat_messages, check_fields, parse, prompt_ids
from service.backends.base import Backend, BackendInfo
from service.errors import DeadlineExceeded, EngineUnavailable, InvalidRequest, Overloaded, ServerShutdown
from service.request import GenerateRequest, RequestOutput
from service.tokenizer import ChatTemplateError, Tokenizer

logger = logging.getLogger(__name__)
T = TypeVar("T")

TOKENIZER_THREADS = 2
DEADLINE_SLACK_S = 0.01  # a cancellation this close to the client's deadline is the deadline

FINISH_REASONS = {"stop": llm_pb2.FINISH_REASON_STOP, "length": llm_pb2.FINISH_REASON_LENGTH}
TIMING_SOURCES = {"engine": llm_pb2.TIMING_SOURCE_ENGINE, "edge": llm_pb2.TIMING_SOURCE_EDGE}


def _chunk(out: RequestOutput) -> llm_pb2.GenerateResponse:
    chunk = llm_pb2.Chunk(text=out.new_text, token_ids=out.new_token_ids)
    for lp in out.logprobs or ():
        chunk.logprobs.add(
            chosen=llm_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob),
            top=[llm_pb2.TokenLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
    return llm_pb2.GenerateResponse(chunk=chunk)


def _complete(request_id: str, out: RequestOutput, completion_tokens: int) -> llm_pb2.GenerateResponse:
    t = out.timing
    # a backend that streams text without token ids (Triton's ensemble) reports the count instead
    completion_tokens = completion_tokens or out.num_output_tokens
    complete = llm_pb2.Complete(
        request_id=request_id,
        finish_reason=FINISH_REASONS.get(out.finish_reason or "", llm_pb2.FINISH_REASON_UNSPECIFIED),
        usage=llm_pb2.Usage(
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=completion_tokens,
            cached_prompt_tokens=out.num_cached_tokens,
        ),
        timing=llm_pb2.Timing(
            queue_ms=t.queue_ms,
            prefill_ms=t.prefill_ms,
            ttft_ms=t.ttft_ms,
            decode_ms=t.decode_ms,
            tpot_ms=t.tpot_ms,
            e2e_ms=t.e2e_ms,
            source=TIMING_SOURCES.get(t.source, llm_pb2.TIMING_SOURCE_UNSPECIFIED),
        ),
    )
    if isinstance(out.stop_reason, str):
        complete.stop_string = out.stop_reason
    elif isinstance(out.stop_reason, int):
        complete.stop_token_id = out.stop_reason
    return llm_pb2.GenerateResponse(complete=complete)


class LLMServicer:
    def __init__(
        self,
        backend_getter: Callable[[], Backend | None],
        metrics: ServiceMetrics,
        max_active_rpcs: int = 1024,
        log_prompts: bool = False,
        max_message_bytes: int | None = None,
    ) -> None:
        self._backend = backend_getter  # None until the backend has loaded and warmed up
        self.metrics = metrics
        self.max_active_rpcs = max_active_rpcs  # LLM RPCs in flight at most; health and reflection never count
        self.log_prompts = log_prompts
        self.max_message_bytes = max_message_bytes  # request messages larger than this are RESOURCE_EXHAUSTED
        self.num_active = 0  # LLM RPCs in progress (the drain waits for them)
        self.draining = False  # set on shutdown: new RPCs get UNAVAILABLE
        self.cut = False  # set at the drain timeout: streams still running end with ServerShutdown
        # tokenization and chat rendering run here, never on the event loop (a huge prompt takes seconds)
        self._pool = ThreadPoolExecutor(max_workers=TOKENIZER_THREADS, thread_name_prefix="tokenize")

    def parse(self, message_type: type[Message], raw: bytes) -> Message:
        """A request message of this server (size-checked, then parsed: service/api/validation.py)."""
        return parse(message_type, raw, self.max_message_bytes)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """One LLM RPC in flight (the Triton front door takes one per inference request)."""
        # NOTE: gRPC core's maximum_concurrent_rpcs would also refuse health checks, so the limit lives here.
        if self.num_active >= self.max_active_rpcs:
            raise Overloaded(f"too many RPCs in flight (limit {self.max_active_rpcs}); retry later")
        self.num_active += 1
        try:
            yield
        finally:
            self.num_active -= 1

    def ready(self) -> Backend:
        """The backend, or EngineUnavailable while loading or draining."""
        if self.draining:
            raise EngineUnavailable("the server is shutting down")
        backend = self._backend()
        if backend is None:
            raise EngineUnavailable("the engine is still loading")
        return backend

    async def off_loop(self, fn: Callable[..., T], *args: object) -> T:
        """Run tokenization-sized work in the servicer's small pool, never on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _to_domain(self, req: llm_pb2.GenerateRequest, backend: Backend) -> GenerateRequest:
        request_id, sampling = check_fields(req)  # cheap checks first
        salt = interceptors.cache_salt(validation.cache_salt(req))
        backend.check_capacity()  # do not tokenize what the queue would refuse anyway
        limits = TextLimits.for_model(backend.tokenizer, backend.info.max_seq_len)
        ids = await self.off_loop(prompt_ids, req, backend.tokenizer, limits)
        return GenerateRequest(
            request_id=request_id, prompt_token_ids=ids, sampling=sampling, priority=req.priority, cache_salt=salt
        )

    async def Generate(self, raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[llm_pb2.GenerateResponse]:
        request_id: str | None = None
        code = grpc.StatusCode.OK
        sent = 0
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        try:
            with self.slot():
                backend = self.ready()
                gen = await self._to_domain(self.parse(llm_pb2.GenerateRequest, raw), backend)
                request_id = gen.request_id
                if deadline is not None and time.monotonic() >= deadline:
                    raise DeadlineExceeded("the deadline had passed before the request was queued")
                if self.log_prompts:
                    logger.info("request %s prompt ids %s", request_id, gen.prompt_token_ids)
                async for out in backend.generate(gen):
                    if out.new_token_ids or out.new_text:
                        sent += len(out.new_token_ids)
                        yield _chunk(out)
                    if out.finished:
                        if out.finish_reason == "abort" and self.cut:
                            raise ServerShutdown("the server shut down before the request finished")
                        yield _complete(request_id, out, sent)
                        _log_finished(request_id, out, sent)
        except (asyncio.CancelledError, GeneratorExit):  # client gone or deadline: grpc closes the generator
            expired = deadline is not None and time.monotonic() >= deadline - DEADLINE_SLACK_S
            code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
            raise  # the AsyncEngine already aborted the request; re-raise (swallowing leaks, grpc#43360)
        except Exception as exc:
            code, message = status_for(exc, request_id, sent)
            await context.abort(code, message)
        finally:
            self.metrics.rpc_finished(code.name)

    @unary_errors
    async def Tokenize(self, raw: bytes, context: grpc.aio.ServicerContext) -> llm_pb2.TokenizeResponse:
        with self.slot():
            backend = self.ready()
            req = self.parse(llm_pb2.TokenizeRequest, raw)
            limits = TextLimits.for_model(backend.tokenizer, backend.info.max_seq_len)
            return await self.off_loop(tokenize, req, backend.tokenizer, limits)

    @unary_errors
    async def GetModelInfo(self, raw: bytes, context: grpc.aio.ServicerContext) -> llm_pb2.ModelInfo:
        with self.slot():
            backend = self.ready()
            self.parse(llm_pb2.GetModelInfoRequest, raw)
            return model_info(backend, self.max_active_rpcs)


def _log_finished(request_id: str, out: RequestOutput, sent: int) -> None:
    t = out.timing
    logger.info(
        "request %s: %d prompt (%d cached) + %d tokens, %s, ttft %.1f ms, tpot %.2f ms, e2e %.1f ms",
        request_id, out.num_prompt_tokens, out.num_cached_tokens, sent, out.finish_reason,
        t.ttft_ms, t.tpot_ms, t.e2e_ms,
    )  # fmt: skip


def tokenize(req: llm_pb2.TokenizeRequest, tokenizer: Tokenizer, limits: TextLimits) -> llm_pb2.TokenizeResponse:
    """The Tokenize RPC's work (slow for big inputs: runs off the event loop)."""
    kind = req.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("one of text or messages is required")
    rendered = ""
    if kind == "text":
        limits.check(len(req.text.encode()), "text")
        ids = tokenizer.encode(req.text)
    else:
        add = not req.messages.HasField("add_generation_prompt") or req.messages.add_generation_prompt
        try:
            rendered = tokenizer.apply_chat_template(chat_messages(req.messages, limits), add)
        except ChatTemplateError as exc:
            raise InvalidRequest(f"messages: {exc}") from None
        ids = tokenizer.encode(rendered, add_special_tokens=False)
    tokens = [tokenizer.id_to_token(i) or "" for i in ids]
    return llm_pb2.TokenizeResponse(token_ids=ids, tokens=tokens, rendered=rendered)


def model_info(backend: Backend, max_concurrent_rpcs: int) -> llm_pb2.ModelInfo:
    i: BackendInfo = backend.info
    return llm_pb2.ModelInfo(
        model_name=i.model_name,
        backend=i.backend,
        architecture=i.architecture,
        vocab_size=i.vocab_size,
        max_seq_len=i.max_seq_len,
        max_batch_size=i.max_batch_size,
        max_num_tokens=i.max_num_tokens,
        kv_block_size=i.kv_block_size,
        num_kv_blocks=i.num_kv_blocks,
        dtype=i.dtype,
        weight_format=i.weight_format,
        prefix_caching=i.prefix_caching,
        eos_token_ids=list(i.eos_token_ids),
        has_chat_template=backend.tokenizer.chat_template is not None,
        max_queue=i.max_queue,
        num_layers=i.num_layers,
        hidden_size=i.hidden_size,
        num_attention_heads=i.num_attention_heads,
        num_key_value_heads=i.num_key_value_heads,
        engine_format_version=i.engine_format_version,
        max_text_bytes=TextLimits.for_model(backend.tokenizer, i.max_seq_len).max_text_bytes,
        max_concurrent_rpcs=max_concurrent_rpcs,
        not_reported=list(i.not_reported),
    )
