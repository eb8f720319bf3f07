"""The serving half of the TensorRT-LLM test double: bindings.executor.Executor, run by our native engine.

It keeps the real Executor's contract as the 1.2 bindings and Triton's own model use it: enqueue_request
returns an id; a background thread runs in-flight batching (our EngineCore, on the native engine the double's
build wrote); await_responses(timeout) hands back Response objects whose Result carries the new token ids
(streaming: deltas), is_final, finish_reasons and, with return_perf_metrics, TimingMetrics as timedeltas on
the steady clock; cancel_request ends a request with FinishReason.CANCELLED; get_latest_iteration_stats
returns the iterations since the last call. TensorRT-LLM's sampling rule is kept too: greedy whenever top_k
is unset/0/1 and top_p unset/0, whatever the temperature. A request's cache_salt_id salts its prefix blocks in the
engine underneath, so KV block reuse follows the salt as it does in TensorRT-LLM. Finish reasons: END_ID for an
end-id end, whose token is not returned (TensorRT-LLM "will stop at the endId, but not include it in the
output": NVIDIA/TensorRT-LLM#2190, 2024; that 1.2.1 still does so is unverified, END_TOKEN_IN_OUTPUT switches
it), STOP_WORDS for a stop word, returned (unverified, STOP_WORD_IN_OUTPUT switches it), LENGTH, CANCELLED.
Admission as TensorRT-LLM's: a prompt over the engine's max_input_len, or over max_num_tokens with chunked
context off, comes back as an error response.

Guided decoding: the executor takes a GuidedDecodingConfig on XGRAMMAR only (TensorRT-LLM 1.2's C++ runtime
refuses LLGUIDANCE, cpp/tensorrt_llm/batch_manager/guidedDecoder.cpp), with a vocabulary of strings, the tokenizer
text and int stop ids; a request's GuidedDecodingParams is turned back into our Constraint (JSON -> json_object,
JSON_SCHEMA -> json_schema, REGEX -> regex, EBNF_GRAMMAR -> gbnf, STRUCTURAL_TAG -> structural_tag) and handed to the
native engine underneath, which enforces it where it can (a constraint it refuses comes back as the request's error
response); a constrained request to an executor without a guided-decoding config is an error response (the real
message is not known here). GuidedDecodingParams without a guide for any type but JSON raises, as its C++
constructor checks ("The guide string must be provided unless using GuideType::kJSON").

Test hooks (not TensorRT-LLM API): fail_next_request(message) makes the next enqueued request come back as an
error response; crash() makes await_responses raise, as a dead executor would.
"""

from __future__ import annotations

import datetime
import json
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from service.engine.core import EngineCore
from service.errors import InvalidRequest
from service.request import Constraint, GenerateRequest, RequestOutput, SamplingParams
from tests.trtllm_double.surface import RECORDER, SurfaceObject

KV_BLOCKS = 256  # the double's "GPU" KV pool
# GuidedDecodingParams.GuideType member -> our constraint kind (the native engine underneath enforces it)
GUIDE_KINDS = {"JSON": "json_object", "JSON_SCHEMA": "json_schema", "REGEX": "regex", "EBNF_GRAMMAR": "gbnf",
               "STRUCTURAL_TAG": "structural_tag"}  # fmt: skip


def _steady(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class ExecutorDouble(SurfaceObject):
    """Generated as bindings.executor.Executor (constructor from the JSON); behaviour below."""

    END_TOKEN_IN_OUTPUT = False  # FinishReason.END_ID: the end token is not in output_token_ids
    STOP_WORD_IN_OUTPUT = True  # FinishReason.STOP_WORDS: the stop word's token is

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        ex = self._namespace
        if self.model_type != ex["ModelType"].DECODER_ONLY:
            raise RuntimeError("the test double serves decoder-only engines")
        engine_dir = Path(self.model_path)
        self._build = json.loads((engine_dir / "config.json").read_text())["build_config"]
        rank0 = json.loads((engine_dir / "rank0.engine").read_text())
        cfg = self.executor_config
        self._check_guided(cfg.guided_decoding_config)
        object.__setattr__(self, "core", EngineCore(
            engine_dir / rank0["native"],
            num_kv_blocks=KV_BLOCKS,
            enable_prefix_caching=cfg.kv_cache_config.enable_block_reuse,
            max_num_seqs=cfg.max_batch_size,
            max_num_batched_tokens=cfg.max_num_tokens,
            kv_events=bool(cfg.kv_cache_config.event_buffer_max_size),
        ))  # fmt: skip
        manager = None
        if self.core.kv_events:  # TensorRT-LLM records events only with event_buffer_max_size > 0
            kv_cache = sys.modules["tensorrt_llm.bindings.executor.kv_cache"]
            manager = kv_cache.KVCacheEventManager.create(cfg.kv_cache_config.event_buffer_max_size, KV_BLOCKS)
        object.__setattr__(self, "_kv_events", manager)
        state = {"lock": threading.Condition(), "responses": deque(), "stats": deque(maxlen=1000), "ids": 0,
                 "adds": [], "cancels": set(), "live": {}, "stop": False, "crashed": False, "fail_next": None}  # fmt: skip
        object.__setattr__(self, "_s", state)
        thread = threading.Thread(target=self._loop, name="executor-double", daemon=True)
        object.__setattr__(self, "_thread", thread)
        thread.start()

    # ---- the API -------------------------------------------------------------------------------------------
    def enqueue_request(self, request: Any) -> int:
        RECORDER.call("tensorrt_llm.bindings.executor.Executor.enqueue_request", ("request",))
        s = self._s
        with s["lock"]:
            s["ids"] += 1
            rid = s["ids"]
            error, s["fail_next"] = s["fail_next"] or self._invalid(request), None
            if error:
                s["responses"].append(self._namespace["Response"](rid, error))
                s["lock"].notify_all()
            else:
                s["adds"].append((rid, request, time.monotonic()))
                s["lock"].notify_all()
        return rid

    def await_responses(self, timeout: datetime.timedelta | None = None) -> list:
        RECORDER.call("tensorrt_llm.bindings.executor.Executor.await_responses", ("timeout",))
        if not isinstance(timeout, datetime.timedelta):
            raise TypeError("await_responses(timeout=...) takes a datetime.timedelta")
        s = self._s
        with s["lock"]:
            if s["crashed"]:
                raise RuntimeError("[TensorRT-LLM][ERROR] executor died (test double)")
            if not s["responses"]:
                s["lock"].wait(timeout.total_seconds())
            out = list(s["responses"])
            s["responses"].clear()
        return out

    def cancel_request(self, id: int) -> None:
        RECORDER.call("tensorrt_llm.bindings.executor.Executor.cancel_request", ("id",))
        with self._s["lock"]:
            self._s["cancels"].add(id)
            self._s["lock"].notify_all()

    def get_latest_iteration_stats(self) -> list:
        RECORDER.call("tensorrt_llm.bindings.executor.Executor.get_latest_iteration_stats", ())
        with self._s["lock"]:
            out = list(self._s["stats"])
            self._s["stats"].clear()
        return out

    def get_kv_cache_event_manager(self) -> Any:
        """The KV event manager (None without KvCacheConfig.event_buffer_max_size, as the real one's optional)."""
        RECORDER.call("tensorrt_llm.bindings.executor.Executor.get_kv_cache_event_manager", ())
        return self._kv_events

    def can_enqueue_requests(self) -> bool:
        return not self._s["stop"]

    def shutdown(self) -> None:
        RECORDER.call("tensorrt_llm.bindings.executor.Executor.shutdown", ())
        with self._s["lock"]:
            self._s["stop"] = True
            self._s["lock"].notify_all()
        self._thread.join(10)

    # ---- test hooks ----------------------------------------------------------------------------------------
    def fail_next_request(self, message: str) -> None:
        self._s["fail_next"] = message

    def crash(self) -> None:
        with self._s["lock"]:
            self._s["crashed"] = True
            self._s["lock"].notify_all()

    # ---- the engine underneath -----------------------------------------------------------------------------
    def _check_guided(self, config: Any) -> None:
        if config is None:
            return
        if config.backend != self._namespace["GuidedDecodingConfig"].GuidedDecodingBackend.XGRAMMAR:
            raise RuntimeError(f"[TensorRT-LLM][ERROR] {config.backend} is not supported in C++ runtime (test double)")
        vocab, stops = config.encoded_vocab, config.stop_token_ids
        if not isinstance(vocab, list) or not vocab or not all(isinstance(t, str) for t in vocab):
            raise TypeError("GuidedDecodingConfig(encoded_vocab=...) takes a non-empty list of str")
        if not isinstance(config.tokenizer_str, str) or not config.tokenizer_str:
            raise TypeError("GuidedDecodingConfig(tokenizer_str=...) takes the tokenizer.json text")
        if not isinstance(stops, list) or not all(type(t) is int and 0 <= t < len(vocab) for t in stops):
            raise TypeError("GuidedDecodingConfig(stop_token_ids=...) takes a list of token ids of the vocabulary")

    def _constraint(self, request: Any) -> Constraint | None:
        params = request.guided_decoding_params
        if params is None:
            return None
        kind = GUIDE_KINDS[params.guide_type.name]
        return Constraint(kind, "" if kind == "json_object" else params.guide)

    def _invalid(self, request: Any) -> str | None:
        if request.guided_decoding_params is not None and self.executor_config.guided_decoding_config is None:
            return "a guided-decoding request to an executor without a GuidedDecodingConfig (test double)"
        n = len(request.input_token_ids)
        if n > self._build["max_input_len"]:
            return f"[TensorRT-LLM][ERROR] input length {n} exceeds max_input_len {self._build['max_input_len']}"
        step = self.executor_config.max_num_tokens or self._build["max_num_tokens"]
        if not self.executor_config.enable_chunked_context and n > step:
            return f"[TensorRT-LLM][ERROR] input length {n} exceeds max_num_tokens {step} without chunked context"
        if n + request.max_tokens > self._build["max_seq_len"]:
            return f"[TensorRT-LLM][ERROR] {n} + {request.max_tokens} exceeds max_seq_len {self._build['max_seq_len']}"
        if not request.output_config.exclude_input_from_output:
            return "the test double only returns outputs without the input (exclude_input_from_output=True)"
        if any(len(w) != 1 for w in request.stop_words or ()):
            return "the test double supports single-token stop words only"
        return None

    def _sampling(self, request: Any) -> SamplingParams:
        c, o = request.sampling_config, request.output_config
        greedy = (c.top_k in (None, 0, 1)) and (c.top_p in (None, 0.0))  # TensorRT-LLM's regularizeTopKTopP
        return SamplingParams(
            max_tokens=request.max_tokens,
            temperature=0.0 if greedy else (1.0 if c.temperature is None else c.temperature),
            top_k=0 if c.top_k in (None, 0) else c.top_k,
            top_p=1.0 if c.top_p in (None, 0.0) else c.top_p,
            min_p=c.min_p or 0.0,
            repetition_penalty=c.repetition_penalty or 1.0,
            presence_penalty=c.presence_penalty or 0.0,
            frequency_penalty=c.frequency_penalty or 0.0,
            seed=c.seed,
            stop_token_ids=tuple(w[0] for w in request.stop_words or ()),
            ignore_eos=request.end_id == -1,
            min_tokens=c.min_tokens or 0,
            logprobs=0 if o.return_log_probs else None,
            skip_special_tokens=False,
            constraint=self._constraint(request),
        )

    def _loop(self) -> None:
        s, core = self._s, self.core
        while True:
            with s["lock"]:
                if s["stop"]:
                    return
                adds, s["adds"] = s["adds"], []
                cancels, s["cancels"] = s["cancels"], set()
            errors = []
            for rid, request, arrival in adds:
                salt = "" if request.cache_salt_id is None else f"trtllm-salt-{request.cache_salt_id}"
                try:  # the native engine compiles a constraint here, and refuses one it cannot take
                    gen = GenerateRequest(str(rid), list(request.input_token_ids), self._sampling(request),
                                          cache_salt=salt)  # fmt: skip
                    req = core.enqueue(gen, str(rid), arrival)
                except InvalidRequest as exc:
                    errors.append(self._namespace["Response"](rid, f"[TensorRT-LLM][ERROR] {exc}"))
                    continue
                if request.end_id is not None and request.end_id >= 0:
                    req.eos_token_ids = frozenset({request.end_id})
                s["live"][rid] = (request, arrival, req)
            outputs = core.abort([str(r) for r in cancels if r in s["live"]])
            if core.has_unfinished_requests():
                outputs += core.step()
            else:
                with s["lock"]:  # idle: until a request or a cancel arrives (or a short poll)
                    if not s["adds"] and not s["cancels"] and not s["stop"]:
                        s["lock"].wait(0.01)
            responses = errors + [self._response(out) for out in outputs]
            if self._kv_events is not None:
                self._kv_events.publish(core.take_kv_events())
            with s["lock"]:
                s["responses"].extend(r for r in responses if r is not None)
                s["stats"].append(self._iteration_stats())
                s["lock"].notify_all()

    def _response(self, out: RequestOutput) -> Any:
        ex, s = self._namespace, self._s
        rid = int(out.request_id)
        request, arrival, req = s["live"][rid]
        if out.finished:
            del s["live"][rid]
        reason, tokens = ex["FinishReason"].NOT_FINISHED, list(out.new_token_ids)
        if out.finished:
            reason = {"length": "LENGTH", "abort": "CANCELLED", "error": "CANCELLED"}.get(out.finish_reason or "")
            if out.finish_reason == "stop":
                reason = "STOP_WORDS" if isinstance(out.stop_reason, int) else "END_ID"
                shown = self.STOP_WORD_IN_OUTPUT if reason == "STOP_WORDS" else self.END_TOKEN_IN_OUTPUT
                tokens = tokens if shown or not tokens else tokens[:-1]
            reason = getattr(ex["FinishReason"], reason)
        perf = None
        if request.output_config.return_perf_metrics:
            times = req.token_times
            timing = ex["TimingMetrics"]._make(
                arrival_time=_steady(arrival),
                first_scheduled_time=_steady(req.first_scheduled_time or 0.0),
                first_token_time=_steady(times[0] if times else 0.0),
                last_token_time=_steady(times[-1] if times else 0.0),
            )
            perf = ex["RequestPerfMetrics"]._make(timing_metrics=timing, first_iter=0, last_iter=0, iter=0)
        logprobs = [lp.logprob for lp in out.logprobs or ()]
        result = ex["Result"]._make(
            is_final=out.finished,
            output_token_ids=[tokens],
            finish_reasons=[reason],
            log_probs=[logprobs[: len(tokens)]] if request.output_config.return_log_probs else None,
            cum_log_probs=None,
            sequence_index=0,
            is_sequence_final=out.finished,
            request_perf_metrics=perf,
        )
        response = ex["Response"]._make(request_id=rid, client_id=None, error_msg="", result=result)
        return response

    def _iteration_stats(self) -> Any:
        ex, core = self._namespace, self.core
        pool = core.kv.pool
        kv = ex["KvCacheStats"]._make(max_num_blocks=pool.num_blocks, free_num_blocks=pool.num_free_blocks,
                                      used_num_blocks=pool.num_used_blocks,
                                      tokens_per_block=core.sched_cfg.block_size)  # fmt: skip
        sched = core.scheduler
        ifb = ex["InflightBatchingStats"]._make(num_scheduled_requests=sched.num_running, num_paused_requests=0)
        return ex["IterationStats"]._make(
            timestamp=time.strftime("%m-%d-%Y %H:%M:%S.000000"),
            num_active_requests=sched.num_running + sched.num_waiting,
            num_queued_requests=sched.num_waiting,
            kv_cache_stats=kv,
            inflight_batching_stats=ifb,
        )


class GuidedDecodingParamsDouble(SurfaceObject):
    """bindings.executor.GuidedDecodingParams: a guide is required for every type but JSON (its C++ constructor)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.guide_type.name != "JSON" and self.guide is None:
            raise RuntimeError("The guide string must be provided unless using GuideType::kJSON.")


class RequestDouble(SurfaceObject):
    """bindings.executor.Request: cache_salt_id converts as nanobind converts a std::optional<uint64_t>."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        salt = self.cache_salt_id
        if salt is not None and (type(salt) is not int or not 0 <= salt < 2**64):
            raise TypeError(f"Request(cache_salt_id=...) takes None or an int in [0, 2^64), got {salt!r}")


class ResponseDouble(SurfaceObject):
    """bindings.executor.Response: Response(request_id, error_msg) is an error response."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "result", None)

    def has_error(self) -> bool:
        return bool(self.error_msg)
