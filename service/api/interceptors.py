"""Server interceptors: bearer-token auth on every method but health."""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

HEALTH_METHODS = (
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    # the Triton front door's health checks (KServe v2's liveness and readiness), answered like grpc.health
    "/inference.GRPCInferenceService/ServerLive",
    "/inference.GRPCInferenceService/ServerReady",
    "/inference.GRPCInferenceService/ModelReady",
)
UNAUTHENTICATED = "missing or invalid bearer token"


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Bearer-token auth on every method but health; tokens compared in constant time.

    A refused call is answered by a handler of the method's own kind, so a streaming RPC (the Triton front
    door's ModelStreamInfer) fails at once instead of after its first request message."""

    def __init__(self, token: str) -> None:
        self._expected = token.encode()

    def allows(self, authorization: str) -> bool:
        scheme, _, token = authorization.strip().partition(" ")
        # NOTE: the auth scheme is case-insensitive (RFC 7235 section 2.1); the token is compared in constant time
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._expected)

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method in HEALTH_METHODS:
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self.allows(str(metadata.get("authorization", ""))):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:  # no such method: UNIMPLEMENTED, as without auth
            return None

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)
            yield  # never reached: makes this an async generator, as streaming handlers are

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny_stream)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny_stream)
        return grpc.unary_unary_rpc_method_handler(deny)


def read_token(path: str) -> str:
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"auth token file {path} is empty")
    return token
