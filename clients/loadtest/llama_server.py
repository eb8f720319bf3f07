"""llama.cpp's llama-server as a load-test target: its native streaming `POST /completion` over plain HTTP/1.1.

The native endpoint, not its OpenAI `/v1/completions`, because it takes token-id prompts (exact lengths, as over
llm.v1), `ignore_eos` and `cache_prompt`, and its stream counts what it decoded (`tokens_predicted`) and ends with
the server's own timings. Every streamed event is one SSE `data:` line of JSON (llama.cpp 0c1e570, the one
scripts/build_llamacpp_peer.sh builds):

    {"content": " Paris", "tokens": [7042], "stop": false, "tokens_predicted": 3, "tokens_evaluated": 128, ...}
    {"content": "", "tokens": [], "stop": true, "tokens_predicted": 3, "tokens_evaluated": 128, "stop_type": "limit",
     "timings": {"prompt_ms": 95.1, "predicted_n": 3, "predicted_per_token_ms": 20.4, ...}, ...}

Only the standard library (clients/loadtest/http.py): asyncio streams for the requests, urllib for the set-up calls
(tokenize, props).
"""

from __future__ import annotations

import time
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path

from clients.loadtest.backends import Sampling
from clients.loadtest.http import SSEDecoder, endpoint, failures_recorded, get_json, post_json, sse_events
from clients.loadtest.metrics import RequestRecord
from clients.loadtest.workload import TokenizerFns, WorkItem

__all__ = ["SSEDecoder", "get_json"]  # re-exported: their home is clients.loadtest.http


def base_url(target: str) -> str:
    """http://HOST:PORT from 'http://HOST:PORT[/]' or 'HOST:PORT' (plain HTTP only)."""
    return endpoint(target, "--protocol llama-server").url


def tokenizer_fns(url: str, headers: dict[str, str] | None = None) -> TokenizerFns:
    """The server's own tokenizer (POST /tokenize): synthetic prompts are cut from it and sent as token ids."""

    def encode(text: str) -> list[int]:
        return post_json(f"{url}/tokenize", {"content": text, "add_special": False}, headers=headers)["tokens"]

    return TokenizerFns(encode, None)


def model_info(url: str, headers: dict[str, str] | None = None) -> dict:
    """What the server says it runs (GET /props): the GGUF's file name and llama.cpp's build."""
    props = get_json(f"{url}/props", headers=headers)
    return {"model_name": Path(props.get("model_path") or "?").name, "backend": f"llama-server {props.get('build_info')}",
            "weight_format": "not reported by llama-server (see the GGUF's name)"}  # fmt: skip


def completion_body(item: WorkItem, sampling: Sampling, cache_prompt: bool = False) -> dict:
    """The /completion request: the prompt as token ids where the workload has them, sampling spelled out.

    llama-server's own defaults differ from ours (top_k 40, top_p 0.95, min_p 0.05), so sampling sends the full
    distribution (top_k 0 = all, top_p 1, min_p 0) and greedy says so with top_k 1. cache_prompt=false: a slot's
    KV is not reused from the request before (no prompt cache, the same work for every request)."""
    greedy = sampling.temperature <= 0
    body = {
        "prompt": item.prompt_token_ids if item.prompt_token_ids is not None else item.prompt,
        "n_predict": item.max_tokens,
        "stream": True,
        "ignore_eos": sampling.ignore_eos,
        "cache_prompt": cache_prompt,
        "temperature": max(sampling.temperature, 0.0),
        "top_k": 1 if greedy else 0,
        "top_p": 1.0,
        "min_p": 0.0,
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    return body


@dataclass(slots=True)
class CompletionChunk:
    """What one streamed /completion event means to the load tester."""

    tokens: int  # tokens decoded since the event before (llama-server holds back a token that ends mid-UTF-8)
    final: bool
    input_tokens: int | None = None  # tokens_evaluated: the prompt as the server counted it
    server_ttft_ms: float | None = None  # timings.prompt_ms: prompt processing (not the wait for a slot)
    server_tpot_ms: float | None = None  # timings.predicted_per_token_ms: generation time / (tokens - 1)
    stop_type: str | None = None


def parse_completion_event(event: dict, tokens_so_far: int) -> CompletionChunk:
    """One `data:` object of the stream -> new tokens, final flag, the server's counts and timers."""
    if "error" in event:
        error = event["error"]
        raise ValueError(error.get("message", error) if isinstance(error, dict) else error)
    decoded = event.get("tokens_predicted")
    new = int(decoded) - tokens_so_far if decoded is not None else len(event.get("tokens") or ())
    chunk = CompletionChunk(
        tokens=max(new, 0), final=bool(event.get("stop")), input_tokens=event.get("tokens_evaluated")
    )
    if chunk.final:
        chunk.stop_type = event.get("stop_type")
        timings = event.get("timings") or {}
        if timings.get("prompt_ms"):
            chunk.server_ttft_ms = float(timings["prompt_ms"])
        if (timings.get("predicted_n") or 0) > 1 and timings.get("predicted_per_token_ms"):
            chunk.server_tpot_ms = float(timings["predicted_per_token_ms"])
    return chunk


class LlamaServerBackend:
    """llama-server's streaming /completion, one HTTP/1.1 connection per request (Connection: close)."""

    def __init__(self, target: str, headers: dict[str, str] | None = None, cache_prompt: bool = False) -> None:
        self.endpoint = endpoint(target, "--protocol llama-server")
        self.headers = headers or {}  # e.g. {"authorization": "Bearer ..."} for llama-server --api-key
        self.cache_prompt = cache_prompt

    async def send(self, item: WorkItem, sampling: Sampling, rec: RequestRecord) -> None:
        body = completion_body(item, sampling, self.cache_prompt)
        rec.send_time = time.perf_counter()  # the connection is part of the request: one per request
        with failures_recorded(rec, "LLAMA-SERVER"):
            async with aclosing(sse_events(self.endpoint, "/completion", body, self.headers)) as events:
                async for event in events:
                    chunk = parse_completion_event(event, rec.output_tokens)
                    if chunk.tokens:
                        rec.chunk_times.append(time.perf_counter())
                        rec.chunk_tokens.append(chunk.tokens)
                    if chunk.final:
                        rec.server_ttft_ms, rec.server_tpot_ms = chunk.server_ttft_ms, chunk.server_tpot_ms
                        if chunk.input_tokens is not None:
                            rec.input_tokens = int(chunk.input_tokens)
                        rec.ok = True
                        return
            rec.error = "HTTP: the stream ended before its final event"

    async def close(self) -> None:
        return None
