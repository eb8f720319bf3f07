"""LLMServicer: protobuf <-> domain conversion and streaming; nothing else.

Handlers receive the raw request bytes (see server.py) so that a malformed message is INVALID_ARGUMENT
naming the field, instead of grpc.aio's UNKNOWN carrying the parser's exception text.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from build_engine import spec
from protos.llm.v1 import llm_pb2
from service.async_engine import AsyncEngine, EngineUnavailable
from service.errors import DeadlineExceeded, status_for
from service.metrics import ServiceMetrics
from service.request import InvalidRequest, RequestOutput
from service.tokenizer import ChatTemplateError
from service.validation import Limits, chat_messages, parse, to_domain

logger = logging.getLogger(__name__)

FINISH_REASONS = {"stop": llm_pb2.FINISH_REASON_STOP, "length": llm_pb2.FINISH_REASON_LENGTH}


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
        engine_getter: Callable[[], AsyncEngine | None],
        metrics: ServiceMetrics,
        log_prompts: bool = False,
    ) -> None:
        self._engine = engine_getter  # None until the engine has loaded and warmed up
        self.metrics = metrics
        self.log_prompts = log_prompts
        self.num_active = 0  # Generate RPCs in progress (the drain waits for them)
        self.draining = False  # set on shutdown: new RPCs get UNAVAILABLE

    def _ready(self) -> AsyncEngine:
        if self.draining:
            raise EngineUnavailable("the server is shutting down")
        engine = self._engine()
        if engine is None:
            raise EngineUnavailable("the engine is still loading")
        return engine

    async def Generate(self, raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[llm_pb2.GenerateResponse]:
        request_id: str | None = None
        code = grpc.StatusCode.OK
        sent = 0
        self.num_active += 1
        try:
            engine = self._ready()
            config = engine.core.config
            req = parse(llm_pb2.GenerateRequest, raw)
            limits = Limits(config.arch.vocab_size, engine.core.sched_cfg.max_seq_len)
            gen = to_domain(req, engine.core.tokenizer, limits)
            request_id = gen.request_id
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceeded("the deadline had passed before the request was queued")
            if self.log_prompts:
                logger.info("request %s prompt ids %s", request_id, gen.prompt_token_ids)
            async for out in engine.generate(gen):
                if out.new_token_ids or out.new_text:
                    sent += len(out.new_token_ids)
                    yield _chunk(out)
                if out.finished:
                    yield _complete(request_id, out, sent)
                    t = out.timing
                    logger.info(
                        "request %s: %d prompt (%d cached) + %d tokens, %s, ttft %.1f ms, tpot %.2f ms, e2e %.1f ms",
                        request_id, out.num_prompt_tokens, out.num_cached_tokens, sent, out.finish_reason,
                        t.ttft_ms, t.tpot_ms, t.e2e_ms,
                    )  # fmt: skip
        except (asyncio.CancelledError, GeneratorExit):  # client gone or deadline: grpc closes the generator
            expired = context.time_remaining()
            code = (
                grpc.StatusCode.DEADLINE_EXCEEDED if expired is not None and expired <= 0 else grpc.StatusCode.CANCELLED
            )
            raise  # the AsyncEngine already aborted the request; re-raise (swallowing leaks, grpc#43360)
        except Exception as exc:
            code, message = status_for(exc, request_id, sent)
            await context.abort(code, message)
        finally:
            self.num_active -= 1
            self.metrics.rpc_finished(code.name)

    async def Tokenize(self, raw: bytes, context: grpc.aio.ServicerContext) -> llm_pb2.TokenizeResponse:
        try:
            tokenizer = self._ready().core.tokenizer
            req = parse(llm_pb2.TokenizeRequest, raw)
            kind = req.WhichOneof("input")
            if kind is None:
                raise InvalidRequest("one of text or messages is required")
            rendered = ""
            if kind == "text":
                ids = tokenizer.encode(req.text)
            else:
                add = not req.messages.HasField("add_generation_prompt") or req.messages.add_generation_prompt
                try:
                    rendered = tokenizer.apply_chat_template(chat_messages(req.messages), add)
                except ChatTemplateError as exc:
                    raise InvalidRequest(f"messages: {exc}") from None
                ids = tokenizer.encode(rendered, add_special_tokens=False)
            tokens = [tokenizer.id_to_token(i) or "" for i in ids]
            return llm_pb2.TokenizeResponse(token_ids=ids, tokens=tokens, rendered=rendered)
        except Exception as exc:
            code, message = status_for(exc, None)
            await context.abort(code, message)

    async def GetModelInfo(self, raw: bytes, context: grpc.aio.ServicerContext) -> llm_pb2.ModelInfo:
        try:
            engine = self._ready()
            parse(llm_pb2.GetModelInfoRequest, raw)
            core = engine.core
            cfg, arch, sched = core.config, core.config.arch, core.sched_cfg
            return llm_pb2.ModelInfo(
                model_name=cfg.model_name,
                backend=cfg.backend,
                architecture=arch.architecture,
                vocab_size=arch.vocab_size,
                max_seq_len=sched.max_seq_len,
                max_batch_size=sched.max_num_seqs,
                max_num_tokens=sched.max_num_batched_tokens,
                kv_block_size=sched.block_size,
                num_kv_blocks=sched.num_kv_blocks,
                dtype=cfg.limits.dtype,
                prefix_caching=sched.enable_prefix_caching,
                eos_token_ids=list(cfg.tokenizer.eos_token_ids),
                has_chat_template=core.tokenizer.chat_template is not None,
                max_queue=engine.config.max_queue,
                num_layers=arch.num_hidden_layers,
                hidden_size=arch.hidden_size,
                num_attention_heads=arch.num_attention_heads,
                num_key_value_heads=arch.num_key_value_heads,
                engine_format_version=spec.FORMAT_VERSION,
            )
        except Exception as exc:
            code, message = status_for(exc, None)
            await context.abort(code, message)
