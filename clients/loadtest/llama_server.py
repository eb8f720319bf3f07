"""llama.cpp's llama-server as a load-test target: its native streaming `POST /completion` over plain HTTP/1.1.

The native endpoint, not its OpenAI `/v1/completions`, because it takes token-id prompts (exact lengths, as over
llm.v1), `ignore_eos` and `cache_prompt`, and its stream counts what it decoded (`tokens_predicted`) and ends with
the server's own timings. Every streamed event is one SSE `data:` line of JSON (llama.cpp 0c1e570, the one
scripts/build_llamacpp_peer.sh builds):

    {"content": " Paris", "tokens": [7042], "stop": false, "tokens_predicted": 3, "tokens_evaluated": 128, ...}
    {"content": "", "tokens": [], "stop": true, "tokens_predicted": 3, "tokens_evaluated": 128, "stop_type": "limit",
     "timings": {"prompt_ms": 95.1, "predicted_n": 3, "predicted_per_token_ms": 20.4, ...}, ...}

Only the standard library: asyncio streams for the requests, urllib for the set-up calls (tokenize, props).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from clients.loadtest.backends import Sampling
from clients.loadtest.metrics import RequestRecord
from clients.loadtest.workload import TokenizerFns, WorkItem


def base_url(target: str) -> str:
    """http://HOST:PORT from 'http://HOST:PORT[/]' or 'HOST:PORT' (plain HTTP only)."""
    url = urlsplit(target if "//" in target else f"http://{target}")
    if url.scheme != "http" or not url.hostname or url.port is None:
        raise ValueError(f"--protocol llama-server takes --target http://HOST:PORT, got {target!r}")
    return f"http://{url.hostname}:{url.port}"


def get_json(url: str, timeout: float = 10.0, headers: dict[str, str] | None = None):
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def post_json(url: str, doc: dict, timeout: float = 30.0, headers: dict[str, str] | None = None):
    req = urllib.request.Request(
        url, json.dumps(doc).encode(), {"Content-Type": "application/json", **(headers or {})}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


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


class SSEDecoder:
    """Bytes of a text/event-stream in, the JSON of each complete `data:` event out."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[dict]:
        self._buf += data.replace(b"\r\n", b"\n")
        events = []
        while b"\n\n" in self._buf:
            block, self._buf = self._buf.split(b"\n\n", 1)
            for line in block.split(b"\n"):
                field, _, value = line.partition(b":")
                value = value.strip()
                if field == b"data" and value and value != b"[DONE]":
                    events.append(json.loads(value))
                elif field == b"error":  # older llama-server: `error: {...}` instead of data
                    events.append({"error": json.loads(value) if value.startswith(b"{") else value.decode()})
        return events


class HTTPStatusError(Exception):
    pass


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    parts = status_line.split(None, 2)
    if len(parts) < 2 or not parts[1].isdigit():
        raise HTTPStatusError(f"bad status line {status_line[:80]!r}")
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        key, _, value = line.decode("latin-1").partition(":")
        headers[key.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The response body as it arrives: chunked, Content-Length, or until the server closes."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while size := int((await reader.readline()).split(b";")[0].strip() or b"0", 16):
            yield await reader.readexactly(size)
            await reader.readexactly(2)  # the CRLF after each chunk
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while data := await reader.read(65536):
            yield data


class LlamaServerBackend:
    """llama-server's streaming /completion, one HTTP/1.1 connection per request (Connection: close)."""

    def __init__(self, target: str, headers: dict[str, str] | None = None, cache_prompt: bool = False) -> None:
        url = urlsplit(base_url(target))
        self.host, self.port = url.hostname, url.port
        self.headers = headers or {}  # e.g. {"authorization": "Bearer ..."} for llama-server --api-key
        self.cache_prompt = cache_prompt

    def _request(self, body: bytes) -> bytes:
        head = [
            "POST /completion HTTP/1.1", f"Host: {self.host}:{self.port}", "Content-Type: application/json",
            "Accept: text/event-stream", f"Content-Length: {len(body)}", "Connection: close",
            *(f"{k}: {v}" for k, v in self.headers.items()),
        ]  # fmt: skip
        return ("\r\n".join(head) + "\r\n\r\n").encode() + body

    async def send(self, item: WorkItem, sampling: Sampling, rec: RequestRecord) -> None:
        body = json.dumps(completion_body(item, sampling, self.cache_prompt)).encode()
        writer = None
        rec.send_time = time.perf_counter()  # the connection is part of the request: one per request
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port)
            writer.write(self._request(body))
            await writer.drain()
            status, headers = await _read_head(reader)
            if status != 200:
                text = b"".join([piece async for piece in _body(reader, headers)])
                raise HTTPStatusError(f"HTTP {status}: {text[:300].decode(errors='replace')}")
            sse = SSEDecoder()
            async for piece in _body(reader, headers):
                for event in sse.feed(piece):
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
        except HTTPStatusError as err:
            rec.error = str(err)
        except (OSError, asyncio.IncompleteReadError) as err:
            rec.error = f"UNAVAILABLE: {type(err).__name__}: {err}"
        except ValueError as err:
            rec.error = f"LLAMA-SERVER: {err}"
        except asyncio.CancelledError:
            rec.error = "CANCELLED: stopped at the run's time limit"
            raise
        finally:
            if writer is not None:
                writer.close()

    async def close(self) -> None:
        return None
