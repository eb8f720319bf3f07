"""The Triton front door's responses: one request's RequestOutput deltas -> its KServe responses (streamed, or one
with everything), an empty final response, an error in a stream."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from tritonclient.grpc import service_pb2

from build_engine.triton_models.tables import (
    COUNT_OUTPUTS,
    DRAFT_OUTPUTS,
    KV_CACHE_OUTPUTS,
    MODEL_VERSION,
    PERF_METRICS_OUTPUTS,
    PERF_OUTPUTS,
)
from service.api.triton.convert import TritonCall
from service.api.triton.tensors import ResponseBuilder
from service.request import RequestOutput

PERF_METRICS = frozenset(PERF_METRICS_OUTPUTS)
Response = service_pb2.ModelInferResponse | service_pb2.ModelStreamInferResponse  # unary | streamed


class Responder:
    """One request's RequestOutput deltas -> its KServe responses (streamed, or one with everything), with the
    shapes TensorRT-LLM's models give them (docs/triton.md): text_output [batch x beams] = [1] (NVIDIA's
    postprocessing returns one flat array), output_ids [1, 1, len], output_log_probs [1, 1, len], every
    per-sequence value [1, 1]."""

    def __init__(
        self, call: TritonCall, prompt_ids: list[int], arrival_ns: int, unary: bool, empty_final: bool,
        block_size: int, decode: Callable[[list[int]], str],
    ) -> None:  # fmt: skip
        self.call, self.prompt_ids, self.arrival_ns = call, prompt_ids, arrival_ns
        self.unary, self.empty_final = unary, empty_final
        self.block_size, self.decode = block_size, decode  # decode: ids -> text, as the postprocessing step
        self.ids: list[int] = []
        self.text: list[str] = []
        self.log_probs: list[float] = []
        self.cum_log_prob = 0.0
        self.extras = bool(call.outputs & {*PERF_METRICS_OUTPUTS, *COUNT_OUTPUTS})

    def delta(self, out: RequestOutput) -> Response | None:
        has = bool(out.new_token_ids or out.new_text)
        log_probs = [lp.logprob for lp in out.logprobs or ()]
        self.cum_log_prob += sum(log_probs)
        if self.call.stream:
            if not out.finished:
                return self._build(out.new_token_ids, out.new_text, log_probs, None) if has else None
            if has or self.extras:
                return self._build(out.new_token_ids, out.new_text, log_probs, out)
            return self.empty() if self.empty_final else None
        self.ids += out.new_token_ids
        self.text.append(out.new_text)
        self.log_probs += log_probs
        if not out.finished:
            return None
        text, ids = "".join(self.text), self.ids
        if not self.call.exclude_input:  # TensorRT-LLM returns prompt + output unless asked not to
            ids = self.prompt_ids + ids
            text = self.decode(ids) if self.call.text is not None else text  # what postprocessing decodes
        return self._build(ids, text, self.log_probs, out, count=len(self.ids))

    def stopped(self) -> Response:
        """The last response of a request ended by a `stop` request (as TensorRT-LLM: final, no new tokens)."""
        return self._build([], "", [], None, final=True)

    def empty(self) -> Response:
        return ResponseBuilder(self.call.model.name, MODEL_VERSION, self.call.client_id, stream=True).final(True)

    def _build(
        self, ids: list[int], text: str, log_probs: list[float], out: RequestOutput | None, count: int | None = None,
        final: bool = False,
    ) -> Response:  # fmt: skip
        want = self.call.outputs
        b = ResponseBuilder(self.call.model.name, MODEL_VERSION, self.call.client_id, stream=not self.unary)

        def one(name: str, datatype: str, value: float) -> None:
            if name in want:
                b.add(name, datatype, np.array([[value]]))

        if "text_output" in want:
            b.add("text_output", "BYTES", np.array([text.encode()], dtype=np.object_))
        if "output_ids" in want:
            b.add("output_ids", "INT32", np.array(ids, dtype=np.int32).reshape(1, 1, len(ids)))
        one("sequence_length", "INT32", len(ids))
        if "output_log_probs" in want:
            b.add("output_log_probs", "FP32", np.array(log_probs, dtype=np.float32).reshape(1, 1, len(log_probs)))
        one("cum_log_probs", "FP32", self.cum_log_prob)
        one("batch_index", "INT32", 0)
        one("sequence_index", "INT32", 0)
        one("num_input_tokens", "INT32", len(self.prompt_ids))
        one("num_output_tokens", "INT32", len(ids) if count is None else count)  # per response, as TensorRT-LLM
        if out is not None and out.finished and out.timing is not None and want & PERF_METRICS:
            for name, value in zip(PERF_OUTPUTS, self._times(out), strict=True):
                one(name, "INT64", value)
            for name, value in zip(KV_CACHE_OUTPUTS, self._blocks(out), strict=True):
                one(name, "INT32", value)
            drafted, accepted = out.timing.spec_draft_tokens, out.timing.spec_accepted_tokens  # 0 without drafts
            one("acceptance_rate", "FP32", accepted / drafted if drafted else 0.0)
            for name, value in zip(DRAFT_OUTPUTS, (accepted, drafted), strict=True):
                one(name, "INT32", value)
        if self.unary:
            return b.response
        return b.final(final or (out is not None and out.finished))

    def _blocks(self, out: RequestOutput) -> tuple[int, int, int]:
        """KV blocks the request held (new, reused from the prefix cache, total): its computed positions (the
        prompt and every output token but the last, which was never fed back) in blocks of block_size."""
        positions = max(1, out.num_prompt_tokens + out.num_output_tokens - 1)
        total = -(-positions // self.block_size)
        reused = min(total, out.num_cached_tokens // self.block_size)
        return total - reused, reused, total

    def _times(self, out: RequestOutput) -> tuple[int, int, int, int]:
        """The engine's timing as steady-clock nanoseconds (time.monotonic_ns, like TensorRT-LLM's)."""
        t, arrival = out.timing, self.arrival_ns
        scheduled = arrival + round(t.queue_ms * 1e6)
        if not out.num_output_tokens:
            return arrival, scheduled, 0, 0
        first = arrival + round(t.ttft_ms * 1e6)
        return arrival, scheduled, first, first + round(t.decode_ms * 1e6)


def empty(call: TritonCall) -> service_pb2.ModelStreamInferResponse:
    return ResponseBuilder(call.model.name, MODEL_VERSION, call.client_id, stream=True).final(True)


def error(message: str, model: str, client_id: str) -> service_pb2.ModelStreamInferResponse:
    resp = service_pb2.ModelStreamInferResponse(error_message=message)
    resp.infer_response.model_name, resp.infer_response.id = model, client_id
    resp.infer_response.parameters["triton_final_response"].bool_param = True
    return resp
