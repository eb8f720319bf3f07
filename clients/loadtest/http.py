"""HTTP/1.1 for the load tester's HTTP protocols (llama-server, OpenAI-compatible servers): the standard library only.

Streaming requests go over asyncio streams, one connection per request (`Connection: close`, plain TCP or TLS),
and their `text/event-stream` bodies are decoded as they arrive; set-up calls (tokenize, model lists) use urllib.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

from clients.loadtest.metrics import RequestRecord


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where an HTTP protocol sends its requests: http(s)://host:port, and the TLS context for https."""

    host: str
    port: int
    tls: ssl.SSLContext | None = None  # https: verifies the certificate and that it names `host`

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"


def endpoint(target: str, what: str, tls: ssl.SSLContext | None = None) -> Endpoint:
    """An Endpoint from 'http://HOST:PORT[/]', 'https://HOST:PORT' (needs `tls`) or 'HOST:PORT' (plain HTTP)."""
    url = urlsplit(target if "//" in target else f"http://{target}")
    schemes = ("http", "https") if tls is not None else ("http",)
    if url.scheme not in schemes or not url.hostname or url.port is None:
        raise ValueError(f"{what} takes --target {' or '.join(f'{s}://HOST:PORT' for s in schemes)}, got {target!r}")
    return Endpoint(url.hostname, url.port, tls if url.scheme == "https" else None)


def tls_context(ca: str | None = None, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    """Verifies the server's certificate and host name, against `ca` (PEM) or the system's CAs; `cert` + `key`
    present a client certificate (mutual TLS)."""
    ctx = ssl.create_default_context(cafile=ca)
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


def get_json(url: str, timeout: float = 10.0, headers: dict[str, str] | None = None, tls: ssl.SSLContext | None = None):
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout, context=tls) as r:
        return json.loads(r.read() or b"null")


def post_json(
    url: str, doc: dict, timeout: float = 30.0, headers: dict[str, str] | None = None, tls: ssl.SSLContext | None = None
):
    req = urllib.request.Request(
        url, json.dumps(doc).encode(), {"Content-Type": "application/json", **(headers or {})}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=timeout, context=tls) as r:
        return json.loads(r.read() or b"null")


class SSEDecoder:
    """Bytes of a text/event-stream in, the JSON of each complete `data:` event out; `done` once `data: [DONE]`
    (the OpenAI API's end of stream) has come."""

    def __init__(self) -> None:
        self._buf = b""
        self.done = False

    def feed(self, data: bytes) -> list[dict]:
        self._buf += data.replace(b"\r\n", b"\n")
        events = []
        while b"\n\n" in self._buf and not self.done:
            block, self._buf = self._buf.split(b"\n\n", 1)
            for line in block.split(b"\n"):
                field, _, value = line.partition(b":")
                value = value.strip()
                if field == b"data" and value == b"[DONE]":
                    self.done = True
                    break
                if field == b"data" and value:
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


def _request(ep: Endpoint, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    head = [
        f"POST {path} HTTP/1.1", f"Host: {ep.host}:{ep.port}", "Content-Type: application/json",
        "Accept: text/event-stream", f"Content-Length: {len(body)}", "Connection: close",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]  # fmt: skip
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def sse_events(ep: Endpoint, path: str, doc: dict, headers: dict[str, str]) -> AsyncIterator[dict]:
    """POST `doc` as JSON to `path` on a connection of its own, and yield each `data:` event of the streamed answer
    as it arrives, until `[DONE]` or the end of the body. A status other than 200 raises HTTPStatusError
    ("HTTP 401: <body>"). Closing the generator (or cancelling its reader) closes the connection."""
    writer = None
    try:
        reader, writer = await asyncio.open_connection(ep.host, ep.port, ssl=ep.tls)
        writer.write(_request(ep, path, json.dumps(doc).encode(), headers))
        await writer.drain()
        status, head = await _read_head(reader)
        if status != 200:
            text = b"".join([piece async for piece in _body(reader, head)])
            raise HTTPStatusError(f"HTTP {status}: {text[:300].decode(errors='replace')}")
        sse = SSEDecoder()
        async for piece in _body(reader, head):
            for event in sse.feed(piece):
                yield event
            if sse.done:
                return
    finally:
        if writer is not None:
            writer.close()


@contextlib.contextmanager
def failures_recorded(rec: RequestRecord, server: str) -> Iterator[None]:
    """A failed request's error into `rec.error`: `HTTP <status>: ...`, `UNAVAILABLE: ...` (refused, reset, TLS),
    `<server>: <message>` (an error event, a malformed one); a cancellation is recorded and propagates."""
    try:
        yield
    except HTTPStatusError as err:
        rec.error = str(err)
    except (OSError, asyncio.IncompleteReadError) as err:
        rec.error = f"UNAVAILABLE: {type(err).__name__}: {err}"
    except ValueError as err:
        rec.error = f"{server}: {err}"
    except asyncio.CancelledError:
        rec.error = "CANCELLED: stopped at the run's time limit"
        raise
