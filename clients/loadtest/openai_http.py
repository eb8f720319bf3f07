"""OpenAI-compatible HTTP servers as a load-test target: streaming `POST /v1/completions` or `/v1/chat/completions`
over SSE (smg in front of this service, vLLM, SGLang, llama-server's /v1, ...).

Each request asks for `"stream": true, "stream_options": {"include_usage": true}` and gets `data:` events of JSON,
then `data: [DONE]`:

    {"choices": [{"index": 0, "text": " Paris", "finish_reason": null}], ...}              completions
    {"choices": [{"index": 0, "delta": {"content": " Paris"}, "finish_reason": null}], ...}  chat
    {"choices": [], "usage": {"prompt_tokens": 31, "completion_tokens": 40, ...}}

The events do not count tokens. Each event whose text is not empty is one chunk of one token (smg and vLLM stream
one event per token); the usage at the end is the request's total: tokens that streamed no text (special tokens,
bytes held back to complete a UTF-8 character) are added to its last chunk, so a request's output tokens are the
server's count while TTFT, ITL and E2E stay the arrival times of text.

Only the standard library (clients/loadtest/http.py): asyncio streams, one HTTP/1.1 connection (TCP or TLS) per
request, so TTFT includes connecting (and the TLS handshake); urllib for GET /v1/models.
"""

from __future__ import annotations

import json
import time
from contextlib import aclosing
from dataclasses import dataclass

from clients.loadtest.backends import Sampling
from clients.loadtest.http import Endpoint, failures_recorded, get_json, sse_events
from clients.loadtest.metrics import RequestRecord
from clients.loadtest.workload import WorkItem

APIS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def models(ep: Endpoint, headers: dict[str, str] | None = None) -> list[dict]:
    """GET /v1/models: what the server serves, [{"id": ..., "owned_by": ...}, ...]."""
    return list((get_json(f"{ep.url}/v1/models", headers=headers, tls=ep.tls) or {}).get("data") or [])


def model_info(ep: Endpoint, model: str | None, api: str, headers: dict[str, str] | None = None) -> dict:
    """For the report: the model the requests name (`model`, else the first that GET /v1/models lists)."""
    try:
        listed = models(ep, headers)
    except OSError:
        if model is None:
            raise
        listed = []  # the named model is used as it is; the requests will say what the server thinks of it
    if model is None:
        if not listed:
            raise ValueError(f"{ep.url}/v1/models lists no model: name one with --model")
        model = str(listed[0]["id"])
    owner = next((m.get("owned_by") for m in listed if m.get("id") == model), None)
    return {"model_name": model, "backend": f"OpenAI {api} API at {ep.url}" + (f", owned by {owner}" if owner else ""),
            "weight_format": "not reported by the OpenAI API"}  # fmt: skip


def request_body(api: str, model: str, item: WorkItem, sampling: Sampling) -> dict:
    """One streaming request. `ignore_eos` (vLLM's extra field, which smg takes too) only when asked, for servers
    that refuse fields they do not know; chat sends the prompt as one user message."""
    body: dict = {"model": model}
    if api == "chat":
        if item.prompt is None:
            raise ValueError("the chat API takes text: give the load tester a --tokenizer to decode prompts")
        body["messages"] = [{"role": "user", "content": item.prompt}]
    else:
        body["prompt"] = item.prompt if item.prompt is not None else item.prompt_token_ids
    body.update(max_tokens=item.max_tokens, temperature=max(sampling.temperature, 0.0), stream=True)
    body["stream_options"] = {"include_usage": True}
    if sampling.ignore_eos:
        body["ignore_eos"] = True
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.json_schema is not None:
        schema = {"name": "loadtest", "schema": json.loads(sampling.json_schema)}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    return body


@dataclass(slots=True)
class OpenAIChunk:
    """What one streamed event means to the load tester."""

    text: str  # the text (chat: content and reasoning_content) of every choice in it
    finished: bool  # a choice has its finish_reason
    usage: dict | None = None


def parse_event(event: dict, api: str) -> OpenAIChunk:
    """One `data:` object of the stream -> its text, whether it ends the output, the usage (last event)."""
    if "error" in event:
        error = event["error"]
        raise ValueError(error.get("message", error) if isinstance(error, dict) else error)
    text, finished = "", False
    for choice in event.get("choices") or ():
        if api == "chat":
            delta = choice.get("delta") or {}
            text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        else:
            text += choice.get("text") or ""
        finished = finished or choice.get("finish_reason") is not None
    return OpenAIChunk(text=text, finished=finished, usage=event.get("usage"))


def settle_usage(rec: RequestRecord, usage: dict | None) -> None:
    """The server's counts into the record: prompt tokens as it counted them (chat: with the template), and the
    output tokens that streamed no text onto the last chunk."""
    if not usage:
        return
    if usage.get("prompt_tokens") is not None:
        rec.input_tokens = int(usage["prompt_tokens"])
    missing = int(usage.get("completion_tokens") or 0) - rec.output_tokens
    if missing > 0 and rec.chunk_tokens:
        rec.chunk_tokens[-1] += missing


class OpenAIBackend:
    """Streaming completions or chat completions, one HTTP/1.1 connection per request (Connection: close)."""

    def __init__(self, ep: Endpoint, model: str, api: str = "completions", headers: dict[str, str] | None = None):
        if api not in APIS:
            raise ValueError(f"--openai-api takes {' or '.join(APIS)}, got {api!r}")
        self.endpoint, self.model, self.api = ep, model, api
        self.headers = headers or {}  # {"authorization": "Bearer KEY"} for a server with an API key

    def body(self, item: WorkItem, sampling: Sampling) -> dict:
        """One request's JSON body (a subclass may send other messages)."""
        return request_body(self.api, self.model, item, sampling)

    async def send(self, item: WorkItem, sampling: Sampling, rec: RequestRecord) -> None:
        body = self.body(item, sampling)
        finished, usage = False, None
        rec.send_time = time.perf_counter()  # the connection is part of the request: one per request
        with failures_recorded(rec, "OPENAI"):
            async with aclosing(sse_events(self.endpoint, APIS[self.api], body, self.headers)) as events:
                async for event in events:
                    chunk = parse_event(event, self.api)
                    if chunk.text:
                        rec.chunk_times.append(time.perf_counter())
                        rec.chunk_tokens.append(1)
                    finished = finished or chunk.finished
                    usage = chunk.usage or usage
            if not finished:
                rec.error = "HTTP: the stream ended before a finish_reason"
                return
            settle_usage(rec, usage)
            rec.ok = True

    async def close(self) -> None:
        return None
