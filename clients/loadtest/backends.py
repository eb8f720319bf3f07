"""Protocols the load generator speaks: our llm.v1 gRPC API, and Triton's KServe v2 gRPC streaming
(TensorRT-LLM ensemble, decoupled mode) through tritonclient."""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import numpy as np

from clients.loadtest.metrics import RequestRecord
from clients.loadtest.workload import WorkItem
from protos.llm.v1 import llm_pb2, llm_pb2_grpc


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float = 0.0
    ignore_eos: bool = True
    seed: int | None = None
    json_schema: str | None = None  # a JSON schema (text) every request's output must match


class Backend(Protocol):
    async def send(self, item: WorkItem, sampling: Sampling, rec: RequestRecord) -> None:
        """Send one request, filling `rec`; a cancellation marks it failed and propagates."""
        ...

    async def close(self) -> None: ...


def _record_chunk(rec: RequestRecord, tokens: int) -> None:
    if tokens:
        rec.chunk_times.append(time.perf_counter())
        rec.chunk_tokens.append(tokens)


class LLMBackend:
    """llm.v1.LLMService over grpc.aio: one channel, many concurrent streams."""

    def __init__(self, channel: grpc.aio.Channel, metadata=()) -> None:
        self._channel = channel
        self._stub = llm_pb2_grpc.LLMServiceStub(self._channel)
        self._metadata = tuple(metadata)

    def request(self, item: WorkItem, sampling: Sampling) -> llm_pb2.GenerateRequest:
        req = llm_pb2.GenerateRequest()
        if item.prompt_token_ids is not None:
            req.prompt_token_ids.ids.extend(item.prompt_token_ids)
        else:
            req.prompt = item.prompt
        req.sampling.temperature = sampling.temperature
        if sampling.seed is not None:
            req.sampling.seed = sampling.seed
        req.stopping.max_tokens = item.max_tokens
        req.stopping.ignore_eos = sampling.ignore_eos
        if sampling.json_schema is not None:
            req.constraint.json_schema = sampling.json_schema
        return req

    async def send(self, item: WorkItem, sampling: Sampling, rec: RequestRecord) -> None:
        call = self._stub.Generate(self.request(item, sampling), metadata=self._metadata)
        rec.send_time = time.perf_counter()
        try:
            async for resp in call:
                if resp.HasField("chunk"):
                    _record_chunk(rec, len(resp.chunk.token_ids))
                else:
                    c = resp.complete
                    rec.server_ttft_ms = c.timing.ttft_ms
                    rec.server_tpot_ms = c.timing.tpot_ms if c.usage.completion_tokens > 1 else None
                    rec.spec_draft_tokens = c.timing.spec_draft_tokens
                    rec.spec_accepted_tokens = c.timing.spec_accepted_tokens
                    rec.input_tokens = c.usage.prompt_tokens
                    rec.ok = True
        except grpc.aio.AioRpcError as err:
            rec.error = f"{err.code().name}: {err.details()}"
        except asyncio.CancelledError:
            call.cancel()
            rec.error = "CANCELLED: stopped at the run's time limit"
            raise

    async def close(self) -> None:
        await self._channel.close()


# ---- Triton ---------------------------------------------------------------------------------------------
TRITON_FINAL = "triton_final_response"


def triton_inputs(item: WorkItem, sampling: Sampling, stream: bool = True) -> list:
    """InferInputs for the TensorRT-LLM `ensemble` model (shapes [1, 1]: batch dim + the tensor's [1])."""
    from tritonclient.grpc import InferInput

    def tensor(name: str, value: Any, datatype: str, np_type) -> InferInput:
        t = InferInput(name, [1, 1], datatype)
        t.set_data_from_numpy(np.array([[value]], dtype=np_type))
        return t

    if item.prompt is None:
        raise ValueError("the Triton ensemble takes text: give the load tester a --tokenizer to decode prompts")
    inputs = [
        tensor("text_input", item.prompt.encode(), "BYTES", np.object_),
        tensor("max_tokens", item.max_tokens, "INT32", np.int32),
        tensor("stream", stream, "BOOL", np.bool_),
        tensor("return_perf_metrics", True, "BOOL", np.bool_),
        tensor("return_num_output_tokens", True, "BOOL", np.bool_),
    ]
    # NOTE: TensorRT-LLM decodes greedily whenever top_k and top_p are both unset (0), whatever the
    # temperature; so sampling sends the full nucleus (top_p=1), and greedy says so with top_k=1.
    if sampling.temperature > 0:
        inputs.append(tensor("temperature", sampling.temperature, "FP32", np.float32))
        inputs.append(tensor("top_p", 1.0, "FP32", np.float32))
    else:
        inputs.append(tensor("top_k", 1, "INT32", np.int32))
    if sampling.ignore_eos:
        inputs.append(tensor("end_id", -1, "INT32", np.int32))  # TensorRT-LLM: no end id, run to max_tokens
    if sampling.seed is not None:
        inputs.append(tensor("seed", sampling.seed, "UINT64", np.uint64))
    return inputs


def _scalar(result, name: str) -> float | None:
    value = result.as_numpy(name)
    return None if value is None or value.size == 0 else float(np.asarray(value).reshape(-1)[0])


@dataclass(slots=True)
class TritonChunk:
    """What one streamed Triton response means to the load tester."""

    text: str
    tokens: int  # tokens this response carries (1 when the model does not report counts)
    final: bool
    server_ttft_ms: float | None = None
    server_tpot_ms: float | None = None


def parse_triton_response(result, tokens_so_far: int) -> TritonChunk:
    """One InferResult of the ensemble's decoupled stream -> text delta, token count, final flag, timers.

    `num_output_tokens` counts the tokens of this response (TensorRT-LLM's backends report per response, not
    a running total); without it a response carrying text counts as one token."""
    response = result.get_response()
    params = response.parameters
    final = TRITON_FINAL in params and params[TRITON_FINAL].bool_param
    raw = result.as_numpy("text_output")
    text = (
        b"".join(x if isinstance(x, bytes) else str(x).encode() for x in raw.reshape(-1)).decode(errors="replace")
        if raw is not None
        else ""
    )
    count = _scalar(result, "num_output_tokens")
    tokens = int(count) if count is not None else (1 if raw is not None and raw.size else 0)
    chunk = TritonChunk(text=text, tokens=max(tokens, 0), final=final)
    arrival, first, last = (_scalar(result, f"{k}_time_ns") for k in ("arrival", "first_token", "last_token"))
    if arrival is not None and first is not None and first > 0:
        chunk.server_ttft_ms = (first - arrival) / 1e6
        n = tokens_so_far + chunk.tokens
        if last is not None and n > 1:
            chunk.server_tpot_ms = (last - first) / 1e6 / (n - 1)
    return chunk


class TritonBackend:
    """Triton's gRPC streaming API via tritonclient. The sync client is used (one stream per client, bridged to
    asyncio) because tritonclient 2.73's aio client cannot ask for the empty final response that tells
    when a decoupled request is complete."""

    def __init__(self, target: str, model: str = "ensemble") -> None:
        self.target = target
        self.model = model

    async def send(self, item: WorkItem, sampling: Sampling, rec: RequestRecord) -> None:
        from tritonclient.grpc import InferenceServerClient

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def callback(q: asyncio.Queue, result, error) -> None:
            loop.call_soon_threadsafe(q.put_nowait, (result, error))

        client = InferenceServerClient(self.target)
        try:
            client.start_stream(callback=functools.partial(callback, queue))
            rec.send_time = time.perf_counter()
            client.async_stream_infer(self.model, triton_inputs(item, sampling), enable_empty_final_response=True)
            while True:
                result, error = await queue.get()
                if error is not None:
                    rec.error = f"TRITON: {error}"
                    break
                chunk = parse_triton_response(result, rec.output_tokens)
                _record_chunk(rec, chunk.tokens)
                if chunk.server_ttft_ms is not None:
                    rec.server_ttft_ms, rec.server_tpot_ms = chunk.server_ttft_ms, chunk.server_tpot_ms
                if chunk.final:
                    rec.ok = True
                    break
        except asyncio.CancelledError:
            rec.error = "CANCELLED: stopped at the run's time limit"
            raise
        finally:
            await asyncio.shield(loop.run_in_executor(None, functools.partial(_close_stream, client, not rec.ok)))

    async def close(self) -> None:
        return None


def _close_stream(client, cancel: bool) -> None:
    try:
        # NOTE: tritonclient 2.73's stop_stream(cancel_requests=True) leaves gRPC's request-sending thread blocked
        # on the stream's request queue (a thread leaked per cancelled stream); the end marker lets it finish
        queue = getattr(getattr(client, "_stream", None), "_request_queue", None)
        if queue is not None:
            queue.put(None)
        client.stop_stream(cancel_requests=cancel)
    finally:
        client.close()
