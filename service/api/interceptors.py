"""Server interceptors: bearer-token auth on every method but health, and the tenant's cache salt.

With several tokens (one per client or tenant) and salt_per_token, the interceptor puts the salt of the token a
call authenticated with in a contextvar of the call's task; the servicers read it through cache_salt(), so two
tenants never share prefix KV blocks (one cannot learn from cached_prompt_tokens or TTFT what another sent).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence
from contextvars import ContextVar
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
# NOTE: a key per process (the prefix cache lives no longer), so a salt seen anywhere cannot be used to test guesses
# of a token offline
_SALT_KEY = secrets.token_bytes(32)
# the cache salt of the tenant whose token authenticated this call ("": none); set per call by AuthInterceptor
TENANT_SALT: ContextVar[str] = ContextVar("tenant_salt", default="")


def token_salt(token: bytes) -> str:
    """A tenant's cache salt: an HMAC-SHA-256 of its token under this process's key (never the token), 64 hex
    digits."""
    return hmac.new(_SALT_KEY, token, hashlib.sha256).hexdigest()


def cache_salt(client_salt: str = "") -> str:
    """The effective cache salt of the current call: the client's, after its tenant's when there is one (the
    tenant's part has a fixed length, so no client salt can make two tenants' salts equal)."""
    tenant = TENANT_SALT.get()
    return f"{tenant}:{client_salt}" if tenant else client_salt


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Bearer-token auth on every method but health; tokens compared in constant time. With salt_per_token, a
    call runs with its token's cache salt (TENANT_SALT).

    A refused call is answered by a handler of the method's own kind, so a streaming RPC (the Triton front
    door's ModelStreamInfer) fails at once instead of after its first request message."""

    def __init__(self, tokens: str | Sequence[str], salt_per_token: bool = False) -> None:
        self._expected = [t.encode() for t in ([tokens] if isinstance(tokens, str) else tokens)]
        self._salts = {t: token_salt(t) for t in self._expected} if salt_per_token else None

    def match(self, authorization: str) -> bytes | None:
        """The token this authorization header carries, if it is one of ours."""
        scheme, _, token = authorization.strip().partition(" ")
        given, found = token.strip().encode(), None
        for expected in self._expected:  # NOTE: every token is compared, each in constant time
            if hmac.compare_digest(given, expected):
                found = expected
        # NOTE: the auth scheme is case-insensitive (RFC 7235 section 2.1)
        return found if scheme.lower() == "bearer" else None

    def salt_for(self, token: bytes) -> str | None:
        """The cache salt of calls made with `token` (one of ours), or None without --cache-salt-per-token."""
        return None if self._salts is None else self._salts[token]

    def allows(self, authorization: str) -> bool:
        return self.match(authorization) is not None

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method in HEALTH_METHODS:
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        token = self.match(str(metadata.get("authorization", "")))
        if token is not None:
            if self._salts is not None:  # the handler runs in this call's task: it sees the value
                TENANT_SALT.set(self._salts[token])
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


def read_tokens(path: str) -> tuple[str, ...]:
    """The bearer tokens of a token file: one per line (a file of one token is the one-line case); blank lines
    and lines starting with # are ignored."""
    lines = (line.strip() for line in Path(path).read_text().splitlines())
    tokens = tuple(dict.fromkeys(line for line in lines if line and not line.startswith("#")))
    if not tokens:
        raise ValueError(f"auth token file {path} holds no token")
    return tokens
