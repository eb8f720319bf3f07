"""The Triton front door's KServe v2 HTTP/REST protocol (`--triton-http-port`, Triton's 8000 by convention), on
aiohttp (why aiohttp: docs/triton.md, measured by benchmarks/http_library_bench.py).

HTTP is a codec here, not a second implementation: each request becomes the gRPC door's protobuf message
(http_codec.py) and runs through the same handlers as on the gRPC port (TritonMetadata's RPCs, ModelInfer, and
TritonInference.infer_stream for generate / generate_stream), with an HttpCall standing in for gRPC's
ServicerContext: the same validation, RPC slots (the edge's, per client connection), statistics, metrics, status
decisions and drain. A status code becomes Triton's HTTP status (http_status) and the error a JSON
`{"error": ...}`.

Health (`/v2/health/live`, `/v2/health/ready`, `/v2/models/{m}/ready`) needs no bearer token, as on gRPC; every
other route does (401 without one, 403 with a token the server does not know).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import NoReturn

import grpc
from aiohttp import web
from google.protobuf.message import Message
from tritonclient.grpc import service_pb2

from service.api.edge import Edge
from service.api.interceptors import TENANT_SALT, UNAUTHENTICATED, AuthInterceptor
from service.api.status import status_for
from service.api.triton import http_codec
from service.api.triton.infer import DECOUPLED_INFER
from service.api.triton.servicer import TritonServicer
from service.errors import MessageTooLarge

logger = logging.getLogger(__name__)

# gRPC status -> HTTP status: Triton's mapping where it has the code (INVALID_ARG 400, NOT_FOUND 404, UNAVAILABLE
# 503, UNSUPPORTED 501, INTERNAL 500; src/http_server.cc HttpCodeFromError), Google's gRPC-HTTP mapping for the rest
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# Triton says these differently on HTTP than on gRPC
HTTP_WORDS = {DECOUPLED_INFER: "HTTP end point doesn't support models with decoupled transaction policy"}
HEALTH_ROUTES = ("live", "ready", "model_ready", "model_version_ready")  # no bearer token needed
SSE = "text/event-stream; charset=utf-8"


class Refused(Exception):
    """A request ends with this HTTP status and error message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class HttpCall:
    """What the edge and the door's handlers use of a gRPC ServicerContext, for one HTTP request: the client
    connection as `peer()`, no deadline, and `abort()` raising Refused with the code's HTTP status."""

    __slots__ = ("_peer",)

    def __init__(self, request: web.Request) -> None:
        peername = request.transport.get_extra_info("peername") if request.transport is not None else None
        self._peer = f"http:{peername[0]}:{peername[1]}" if peername else "http:unknown"

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> None:
        return None

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise Refused(HTTP_STATUS.get(code, 500), HTTP_WORDS.get(details, details))


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


class TritonHttp:
    """The HTTP/REST routes over the Triton servicer's parts (the gRPC door's, with its statistics and drain)."""

    def __init__(
        self, servicer: TritonServicer, edge: Edge, auth: AuthInterceptor | None, shutdown_timeout_s: float
    ) -> None:
        self.metadata, self.inference, self.edge, self.auth = servicer.metadata, servicer.inference, edge, auth
        # a body holding more than --max-message-bytes of tensors is refused after decoding; JSON takes more room
        # than the tensors it holds, so the transport's own bound is twice that (as the gRPC door's)
        self.app = web.Application(middlewares=[self._errors, self._authenticate],
                                   client_max_size=2 * edge.max_message_bytes)  # fmt: skip
        self._routes()
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout_s
        )
        self._stopping: asyncio.Future | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        """Listen on host:port (0: a free port); the port bound."""
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context, reuse_port=False)
        await site.start()
        return self._runner.addresses[0][1]

    async def stop(self) -> None:
        """Close the listener and idle connections now; requests in flight finish (the drain ends them at its
        timeout), then the connections close. Idempotent."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._runner.cleanup())
        await asyncio.shield(self._stopping)

    # ---- middlewares -------------------------------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        """Every refusal as Triton's JSON error: a status from a handler, a domain error raised before one ran
        (the codec's), aiohttp's own (404, 405, 413)."""
        try:
            return await handler(request)
        except Refused as exc:
            return _error(exc.status, str(exc))
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _error(exc.status, exc.reason if exc.status != 413 else exc.text or exc.reason)
        except MessageTooLarge as exc:
            return _error(413, str(exc))
        except Exception as exc:
            code, message = status_for(exc, None)
            return _error(HTTP_STATUS.get(code, 500), message)

    @web.middleware
    async def _authenticate(self, request: web.Request, handler):
        """Bearer-token auth on every route but health (the gRPC door's tokens and cache salts)."""
        route = request.match_info.route.name
        if self.auth is None or route in HEALTH_ROUTES or request.match_info.http_exception is not None:
            return await handler(request)
        header = request.headers.get("Authorization", "")
        token = self.auth.match(header)
        if token is None:
            if not header.strip():
                return _error(401, UNAUTHENTICATED, {"WWW-Authenticate": "Bearer"})
            return _error(403, UNAUTHENTICATED)  # as Triton answers a restricted API called with a wrong key
        salt = self.auth.salt_for(token)
        if salt is not None:  # the handler runs in this task: it sees the value
            TENANT_SALT.set(salt)
        return await handler(request)

    # ---- routes ------------------------------------------------------------------------------------------------
    def _routes(self) -> None:
        models, version = "/v2/models/{model}", "/v2/models/{model}/versions/{version:[0-9]+}"
        r = self.app.router
        r.add_get("/v2", self.server_metadata)
        r.add_get("/v2/health/live", self.live, name="live")
        r.add_get("/v2/health/ready", self.ready, name="ready")
        r.add_get("/v2/models/stats", self.statistics)
        r.add_post("/v2/repository/index", self.repository_index)
        for prefix, suffix in ((models, ""), (version, "_version")):
            r.add_get(prefix, self.model_metadata)
            r.add_get(prefix + "/ready", self.model_ready, name=f"model{suffix}_ready")
            r.add_get(prefix + "/config", self.model_config)
            r.add_get(prefix + "/stats", self.statistics)
            r.add_post(prefix + "/infer", self.infer)
            r.add_post(prefix + "/generate", self.generate)
            r.add_post(prefix + "/generate_stream", self.generate_stream)
        for path in ("/v2/repository/models/{model}/{action:load|unload}", "/v2/trace/setting", "/v2/logging",
                     models + "/trace/setting", "/v2/{kind:systemsharedmemory|cudasharedmemory}{rest:.*}"):  # fmt: skip
            r.add_route("*", path, self.unsupported)

    async def unsupported(self, request: web.Request) -> web.Response:
        return _error(501, f"{request.path} is not supported by this server")

    async def _unary(self, method: Callable[..., Awaitable[Message]], message: Message, request: web.Request):
        """One of the gRPC door's unary handlers, on this request's message."""
        return await method(message.SerializeToString(), HttpCall(request))

    @staticmethod
    def _json(message: Message) -> web.Response:
        return web.json_response(http_codec.message_json(message), dumps=_dumps)

    # ---- health, metadata, configuration, statistics -------------------------------------------------------------
    async def live(self, request: web.Request) -> web.Response:
        resp = await self._unary(self.metadata.ServerLive, service_pb2.ServerLiveRequest(), request)
        return web.Response(status=200 if resp.live else 400)

    async def ready(self, request: web.Request) -> web.Response:
        resp = await self._unary(self.metadata.ServerReady, service_pb2.ServerReadyRequest(), request)
        return web.Response(status=200 if resp.ready else 400)

    async def model_ready(self, request: web.Request) -> web.Response:
        m = request.match_info
        msg = service_pb2.ModelReadyRequest(name=m["model"], version=m.get("version", ""))
        if (await self._unary(self.metadata.ModelReady, msg, request)).ready:
            return web.Response()
        return _error(400, "Model version not ready")  # Triton's words, for an unknown model too

    async def server_metadata(self, request: web.Request) -> web.Response:
        msg = service_pb2.ServerMetadataRequest()
        return self._json(await self._unary(self.metadata.ServerMetadata, msg, request))

    async def model_metadata(self, request: web.Request) -> web.Response:
        m = request.match_info
        msg = service_pb2.ModelMetadataRequest(name=m["model"], version=m.get("version", ""))
        return self._json(await self._unary(self.metadata.ModelMetadata, msg, request))

    async def model_config(self, request: web.Request) -> web.Response:
        m = request.match_info
        msg = service_pb2.ModelConfigRequest(name=m["model"], version=m.get("version", ""))
        resp = await self._unary(self.metadata.ModelConfig, msg, request)
        return self._json(resp.config)

    async def statistics(self, request: web.Request) -> web.Response:
        m = request.match_info
        msg = service_pb2.ModelStatisticsRequest(name=m.get("model", ""), version=m.get("version", ""))
        return self._json(await self._unary(self.metadata.ModelStatistics, msg, request))

    async def repository_index(self, request: web.Request) -> web.Response:
        resp = await self._unary(self.metadata.RepositoryIndex, service_pb2.RepositoryIndexRequest(), request)
        return web.json_response(http_codec.message_json(resp)["models"], dumps=_dumps)

    # ---- inference ---------------------------------------------------------------------------------------------
    def _encode(self, req: service_pb2.ModelInferRequest) -> bytes:
        raw = req.SerializeToString()
        if len(raw) > self.edge.max_message_bytes:  # the gRPC door's limit (edge.parse), as HTTP's 413
            raise MessageTooLarge(
                f"request tensors are {len(raw)} bytes, over the server's limit of {self.edge.max_message_bytes} "
                "(--max-message-bytes)"
            )
        return raw

    async def infer(self, request: web.Request) -> web.Response:
        m = request.match_info
        body = await request.read()
        req, fmt = http_codec.infer_request(
            body, request.headers.get(http_codec.HEADER_LENGTH), m["model"], m.get("version", "")
        )
        resp = await self.inference.ModelInfer(self._encode(req), HttpCall(request))
        out, header_length = http_codec.infer_response(resp, fmt)
        if header_length is None:
            return web.Response(body=out, content_type="application/json")
        headers = {http_codec.HEADER_LENGTH: str(header_length)}
        return web.Response(body=out, content_type="application/octet-stream", headers=headers)

    async def _requests(self, request: web.Request, streaming: bool):
        m = request.match_info
        spec = self.inference.models.find(m["model"], m.get("version", ""))
        req = http_codec.generate_request(await request.read(), spec, m.get("version", ""), streaming)
        return self.inference.infer_stream(self._encode(req), HttpCall(request))

    async def generate(self, request: web.Request) -> web.Response:
        """One response (Triton's generate): a request that would stream is refused before it runs."""
        results = []
        async with contextlib.aclosing(await self._requests(request, streaming=False)) as responses:
            async for resp in responses:
                results.append(resp.infer_response)
        if len(results) != 1:
            raise Refused(500, http_codec.ONE_RESPONSE)
        return web.Response(body=http_codec.generate_response(results[0]), content_type="application/json")

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events, one per response; an error before the first is an HTTP error, one after it an
        `{"error": ...}` event (Triton's generate_stream)."""
        async with contextlib.aclosing(await self._requests(request, streaming=True)) as responses:
            first = await anext(responses, None)
            stream = web.StreamResponse(headers={"Content-Type": SSE, "Cache-Control": "no-cache"})
            await stream.prepare(request)
            try:
                resp = first
                while resp is not None:
                    await stream.write(b"data: " + http_codec.generate_response(resp.infer_response) + b"\n\n")
                    resp = await anext(responses, None)
            except Refused as exc:
                await stream.write(b"data: " + _dumps({"error": str(exc)}).encode() + b"\n\n")
        await stream.write_eof()
        return stream


def _dumps(doc: object) -> str:
    return json.dumps(doc, separators=(",", ":"))
