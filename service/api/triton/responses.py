"""The Triton front door's responses: one request's RequestOutput deltas -> its KServe responses (streamed, or one
with everything), an empty final response, an error in a stream."""

from __future__ import annotations

import numpy as np
from tritonclient.grpc import service_pb2

from build_engine.triton_models.tables import COUNT_OUTPUTS, MODEL_VERSION, PERF_OUTPUTS
from service.api.triton.convert import TritonCall
from service.api.triton.tensors import ResponseBuilder
from service.request import RequestOutput

Response = service_pb2.ModelInferResponse | service_pb2.ModelStreamInferResponse  # unary | streamed


class Responder:
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


def empty(call: TritonCall) -> service_pb2.ModelStreamInferResponse:
    return ResponseBuilder(call.model.name, MODEL_VERSION, call.client_id, stream=True).final(True)


def error(message: str, model: str, client_id: str) -> service_pb2.ModelStreamInferResponse:
    resp = service_pb2.ModelStreamInferResponse(error_message=message)
    resp.infer_response.model_name, resp.infer_response.id = model, client_id
    resp.infer_response.parameters["triton_final_response"].bool_param = True
    return resp
