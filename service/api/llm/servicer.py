"""LLMServicer: protobuf <-> domain conversion and streaming; nothing else.

Handlers receive the raw request bytes (see server.py) so that a malformed message is INVALID_ARGUMENT
naming the field, instead of grpc.aio's UNKNOWN carrying the parser's exception text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from protos.llm.v1 import llm_pb2
from service.api import interceptors
from service.api.edge import Edge
from service.api.llm import convert
from service.api.llm.convert import PromptInput, check_fields, prompt_ids, prompt_input
from service.api.metrics import ServiceMetrics
from service.api.status import unary_errors
from service.api.validation import TextLimits
from service.backends.base import Backend, BackendInfo
from service.errors import DeadlineExceeded, InvalidRequest, ServerShutdown
from service.limits import check_constraint
from service.request import CONSTRAINT_FIELDS, GenerateRequest, RequestOutput
from service.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

REPLY_SLICE = 8192  # tokens per protobuf call when a Tokenize reply is built

FINISH_REASONS = {"stop": llm_pb2.FINISH_REASON_STOP, "length": llm_pb2.FINISH_REASON_LENGTH}
TIMING_SOURCES = {"engine": llm_pb2.TIMING_SOURCE_ENGINE, "edge": llm_pb2.TIMING_SOURCE_EDGE}


def _chunk(out: RequestOutput) -> llm_pb2.GenerateResponse:
    resp = llm_pb2.GenerateResponse()
    chunk = resp.chunk  # filled in place: a Chunk built apart would be copied into the response
    chunk.text = out.new_text
    chunk.token_ids.extend(out.new_token_ids)
    for lp in out.logprobs or ():
        chunk.logprobs.add(
            chosen=llm_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob),
            top=[llm_pb2.TokenLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
    return resp


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
            spec_draft_tokens=t.spec_draft_tokens,
            spec_accepted_tokens=t.spec_accepted_tokens,
        ),
    )
    if isinstance(out.stop_reason, str):
        complete.stop_string = out.stop_reason
    elif isinstance(out.stop_reason, int):
        complete.stop_token_id = out.stop_reason
    return llm_pb2.GenerateResponse(complete=complete)


class LLMServicer:
    def __init__(self, edge: Edge, metrics: ServiceMetrics, log_prompts: bool = False) -> None:
        self.edge = edge  # slots, drain state, the stall watch, parsing and tokenization: shared by the front doors
        self.metrics = metrics
        self.log_prompts = log_prompts

    async def _to_domain(self, req: llm_pb2.GenerateRequest, backend: Backend, peer: str) -> GenerateRequest:
        request_id, sampling = check_fields(req)  # cheap checks first
        check_constraint(sampling, backend.info.constraint_kinds, backend.info.backend)
        salt = interceptors.cache_salt(convert.cache_salt(req))
        backend.check_capacity()  # do not tokenize what the queue would refuse anyway
        limits = TextLimits.for_model(backend.tokenizer, backend.info.max_seq_len)
        prompt = prompt_input(req, limits)
        ids = await self.edge.tokenize(
            peer, prompt.num_bytes, limits,
            prompt_ids, prompt, backend.tokenizer, sampling.max_tokens, backend.info.max_seq_len,
        )  # fmt: skip
        return GenerateRequest(
            request_id=request_id, prompt_token_ids=ids, sampling=sampling, priority=req.priority, cache_salt=salt
        )

    async def Generate(self, raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[llm_pb2.GenerateResponse]:
        peer = context.peer()
        async with self.edge.outcome(context, lambda call: self.metrics.rpc_finished(call.code.name)) as call:
            with self.edge.slot(peer) as slot, self.edge.watch_writes(context) as writes:
                call.writes = writes
                backend = self.edge.admit()
                gen = await self._to_domain(self.edge.parse(llm_pb2.GenerateRequest, raw), backend, peer)
                call.request_id = gen.request_id
                if call.past_deadline():
                    raise DeadlineExceeded("the deadline had passed before the request was queued")
                if self.log_prompts:
                    logger.info("request %s prompt ids %s", gen.request_id, gen.prompt_token_ids)
                # the slot ends with the request's work; closing `outputs` (whatever ends this handler) aborts it
                async with contextlib.aclosing(backend.generate(gen, on_done=slot.release)) as outputs:
                    writes.on_stall = lambda: _spawn(outputs.aclose())  # a stalled reader: abort the request now
                    async for out in outputs:
                        if out.new_token_ids or out.new_text:
                            call.tokens += len(out.new_token_ids)
                            writes.pending()
                            yield _chunk(out)
                            writes.sent()
                        if out.finished:
                            if out.finish_reason == "abort" and self.edge.cut:
                                raise ServerShutdown("the server shut down before the request finished")
                            writes.pending()
                            yield _complete(gen.request_id, out, call.tokens)
                            writes.sent()
                            _log_finished(gen.request_id, out, call.tokens)

    @unary_errors
    async def Tokenize(self, raw: bytes, context: grpc.aio.ServicerContext) -> llm_pb2.TokenizeResponse:
        peer = context.peer()
        with self.edge.slot(peer):
            backend = self.edge.admit()
            req = self.edge.parse(llm_pb2.TokenizeRequest, raw)
            kind = req.WhichOneof("input")
            if kind is None:
                raise InvalidRequest("one of text or messages is required")
            limits = TextLimits.for_model(backend.tokenizer, backend.info.max_seq_len)
            prompt = PromptInput.of(kind, getattr(req, kind), limits)
            resp = await self.edge.tokenize(peer, prompt.num_bytes, limits, tokenize, prompt, backend.tokenizer)
            self.edge.check_reply(resp, "the Tokenize reply", "tokenize less text at once")
            return resp

    @unary_errors
    async def GetModelInfo(self, raw: bytes, context: grpc.aio.ServicerContext) -> llm_pb2.ModelInfo:
        with self.edge.slot(context.peer()):
            backend = self.edge.admit()
            self.edge.parse(llm_pb2.GetModelInfoRequest, raw)
            return model_info(backend, self.edge.max_rpcs)


_BACKGROUND: set[asyncio.Task] = set()


def _spawn(coro) -> None:
    """Run a coroutine in the background, keeping a reference until it is done."""
    task = asyncio.ensure_future(coro)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


def _log_finished(request_id: str, out: RequestOutput, sent: int) -> None:
    t = out.timing
    logger.info(
        "request %s: %d prompt (%d cached) + %d tokens, %s, ttft %.1f ms, tpot %.2f ms, e2e %.1f ms",
        request_id, out.num_prompt_tokens, out.num_cached_tokens, sent, out.finish_reason,
        t.ttft_ms, t.tpot_ms, t.e2e_ms,
    )  # fmt: skip


def tokenize(prompt: PromptInput, tokenizer: Tokenizer) -> llm_pb2.TokenizeResponse:
    """The Tokenize RPC's work (slow for big inputs: runs in the pool)."""
    text = prompt.render(tokenizer)
    ids, tokens = tokenizer.encode_with_tokens(text, add_special_tokens=prompt.messages is None)
    resp = llm_pb2.TokenizeResponse(rendered=text if prompt.messages is not None else "")
    for i in range(0, len(ids), REPLY_SLICE):  # in slices: one protobuf call for 200k tokens holds the GIL 30 ms
        resp.token_ids.extend(ids[i : i + REPLY_SLICE])
        resp.tokens.extend(tokens[i : i + REPLY_SLICE])
    return resp


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
        constraint_kinds=[CONSTRAINT_FIELDS[k] for k in i.constraint_kinds],
        kv_cache_dtype=i.kv_cache_dtype,
        speculative_method=i.speculative_method,
        num_speculative_tokens=i.num_speculative_tokens,
    )
