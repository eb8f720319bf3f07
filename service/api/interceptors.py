"""Server interceptors: bearer-token auth on every method but health."""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

HEALTH_METHODS = ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Bearer-token auth on every method but health; tokens compared in constant time."""

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

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        return grpc.unary_unary_rpc_method_handler(deny)


def read_token(path: str) -> str:
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"auth token file {path} is empty")
    return token
