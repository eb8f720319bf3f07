"""The triton backend's wire format: tritonclient's channel arguments and stream shutdown, the request tensors of
TensorRT-LLM's `tensorrt_llm` and `ensemble` models (a constraint as their guided-decoding inputs), and what their
responses carry (token ids, text, the server's timing stamps)."""

from __future__ import annotations

from typing import Any

import numpy as np
from tritonclient.grpc import InferenceServerClient, InferInput

from service.backends.remote import EndIds, sampling_values
from service.backends.trtllm_guided import guide
from service.config import TritonConfig
from service.errors import InvalidRequest
from service.request import Constraint, GenerateRequest, SamplingParams

FINAL = "triton_final_response"
PERF = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")
# GuidedDecodingParams.GuideType member -> the models' guided_decoding_guide_type value: the C++ backend's map
# (inflight_batcher_llm/src/utils.cc getGuidedDecodingParamsFromTensors), which has no structural_tag
GUIDE_TYPE_VALUES = {"JSON": "json", "JSON_SCHEMA": "json_schema", "REGEX": "regex", "EBNF_GRAMMAR": "ebnf_grammar"}
# the Constraint kinds that reach a Triton server (BackendInfo.constraint_kinds): xgrammar's, less structural_tag
CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "gbnf", "choice")


def channel_args(cfg: TritonConfig) -> list[tuple[str, int]]:
    """tritonclient's defaults (unbounded message sizes) plus keepalive, and a short reconnect backoff so a
    Triton server that comes back is seen again within seconds."""
    return [
        ("grpc.max_send_message_length", 2**31 - 1),
        ("grpc.max_receive_message_length", 2**31 - 1),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.min_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", int(max(1.0, cfg.health_period_s) * 1000)),
    ]


def end_requests(client: InferenceServerClient) -> None:
    """End the request side of the client's stream (what stop_stream(cancel_requests=False) does first).

    NOTE: tritonclient 2.73's stop_stream(cancel_requests=True) cancels the call but leaves gRPC's thread that
    sends the requests blocked on the stream's request queue for ever: one leaked thread per stream. Putting the
    end marker in first lets that thread finish; the cancel then ends the call at once."""
    stream = getattr(client, "_stream", None)
    queue = getattr(stream, "_request_queue", None)
    if queue is not None:
        queue.put(None)


def tensor(name: str, value: Any, datatype: str, dtype: Any) -> InferInput:
    arr = np.asarray(value, dtype=dtype)
    arr = arr.reshape(1, *arr.shape) if arr.ndim else arr.reshape(1, 1)
    t = InferInput(name, list(arr.shape), datatype)
    t.set_data_from_numpy(arr)
    return t


# TensorRT-LLM's sampling field -> (the input of each Triton model, datatype, numpy type)
_SAMPLING_INPUTS = {
    "seed": ({"tensorrt_llm": "seed", "ensemble": "seed"}, "UINT64", np.uint64),
    "top_k": ({"tensorrt_llm": "runtime_top_k", "ensemble": "top_k"}, "INT32", np.int32),
    "top_p": ({"tensorrt_llm": "runtime_top_p", "ensemble": "top_p"}, "FP32", np.float32),
    "temperature": ({"tensorrt_llm": "temperature", "ensemble": "temperature"}, "FP32", np.float32),
    "min_tokens": ({"tensorrt_llm": "min_tokens", "ensemble": "min_tokens"}, "INT32", np.int32),
    "repetition_penalty": (
        {"tensorrt_llm": "repetition_penalty", "ensemble": "repetition_penalty"},
        "FP32",
        np.float32,
    ),
    "presence_penalty": ({"tensorrt_llm": "presence_penalty", "ensemble": "presence_penalty"}, "FP32", np.float32),
    "frequency_penalty": ({"tensorrt_llm": "frequency_penalty", "ensemble": "frequency_penalty"}, "FP32", np.float32),
}


def sampling_tensors(p: SamplingParams, model: str) -> list[InferInput]:
    """Sampling and stopping as TensorRT-LLM reads them (remote.sampling_values), as the given model's inputs
    (min_p has none: refused before)."""
    out = []
    for name, value in sampling_values(p).items():
        inputs, datatype, dtype = _SAMPLING_INPUTS[name]
        out.append(tensor(inputs[model], value, datatype, dtype))
    return out


def _string(name: str, value: str) -> InferInput:
    return tensor(name, np.array([value.encode()], dtype=np.object_), "BYTES", np.object_)


def guided_inputs(constraint: Constraint | None) -> list[InferInput]:
    """A constraint as the guided_decoding_guide_type / guided_decoding_guide inputs (TensorRT-LLM's xgrammar on the
    server: the trtllm backend's mapping, trtllm_guided.py); InvalidRequest naming what the server cannot take."""
    if constraint is None:
        return []
    member, text = guide(constraint)  # lark and any_whitespace=false refused there
    value = GUIDE_TYPE_VALUES.get(member)
    if value is None:
        raise InvalidRequest(
            f"constraint kind {constraint.kind}: TensorRT-LLM's Triton backend maps no such guided_decoding_guide_type "
            "(json, json_schema, regex, ebnf_grammar only) and would ignore it"
        )
    out = [_string("guided_decoding_guide_type", value)]
    if text is not None:
        out.append(_string("guided_decoding_guide", text))
    return out


def token_inputs(gen: GenerateRequest, end_ids: EndIds) -> list[InferInput]:
    """The tensorrt_llm model's inputs for a request: token ids, our sampling, end and stop ids."""
    p, ids = gen.sampling, list(gen.prompt_token_ids)
    inputs = [
        tensor("input_ids", ids, "INT32", np.int32),
        tensor("input_lengths", len(ids), "INT32", np.int32),
        tensor("request_output_len", p.max_tokens, "INT32", np.int32),
        tensor("streaming", True, "BOOL", np.bool_),
        tensor("end_id", end_ids.end_id_for(p), "INT32", np.int32),
        tensor("pad_id", end_ids.pad_id, "INT32", np.int32),
        tensor("exclude_input_in_output", True, "BOOL", np.bool_),
        tensor("return_perf_metrics", True, "BOOL", np.bool_),
        *sampling_tensors(p, "tensorrt_llm"),
        *guided_inputs(p.constraint),
    ]
    words = end_ids.stop_words(p)
    if words:  # single-token stop words: ids, then cumulative end offsets
        inputs.append(tensor("stop_words_list", [words, list(range(1, len(words) + 1))], "INT32", np.int32))
    return inputs


def ensemble_inputs(gen: GenerateRequest, text: str) -> list[InferInput]:
    """The ensemble model's inputs for a request: its text (the ensemble tokenizes it again), our sampling."""
    p = gen.sampling
    inputs = [
        _string("text_input", text),
        tensor("max_tokens", p.max_tokens, "INT32", np.int32),
        tensor("stream", True, "BOOL", np.bool_),
        tensor("exclude_input_in_output", True, "BOOL", np.bool_),
        tensor("return_perf_metrics", True, "BOOL", np.bool_),
        tensor("return_num_input_tokens", True, "BOOL", np.bool_),
        tensor("return_num_output_tokens", True, "BOOL", np.bool_),
        *sampling_tensors(p, "ensemble"),
        *guided_inputs(p.constraint),
    ]
    if p.ignore_eos:
        inputs.append(tensor("end_id", -1, "INT32", np.int32))
    return inputs


def streamed_tokens(result: Any) -> list[int]:
    """The new token ids of a tensorrt_llm response (output_ids cut at its sequence_length)."""
    raw, length = result.as_numpy("output_ids"), result.as_numpy("sequence_length")
    new = [] if raw is None else raw.reshape(-1).tolist()
    if length is not None and new:
        new = new[: int(length.reshape(-1)[0])]
    return new


def streamed_text(result: Any) -> tuple[str, int]:
    """The new text of an ensemble response and how many tokens it holds (num_output_tokens; 1 if absent)."""
    raw, count = result.as_numpy("text_output"), result.as_numpy("num_output_tokens")
    piece = "" if raw is None else b"".join(raw.reshape(-1)).decode("utf-8", errors="replace")
    return piece, int(count.reshape(-1)[0]) if count is not None else (1 if piece else 0)


def is_final(result: Any) -> bool:
    params = result.get_response().parameters
    return FINAL in params and params[FINAL].bool_param


def stamps(result: Any) -> tuple[float, ...] | None:
    """The server's *_time_ns outputs in seconds of its steady clock, or None when it returns none."""
    stamps = [result.as_numpy(name) for name in PERF]
    if any(s is None for s in stamps):
        return None
    return tuple(int(s.reshape(-1)[0]) / 1e9 for s in stamps)
