"""Exceptions -> gRPC status codes, in one place (docs/api.md, "Status codes")."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from service.errors import (
    DataLoss,
    DeadlineExceeded,
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    MessageTooLarge,
    NotFound,
    OutOfRange,
    Overloaded,
    ServerShutdown,
    StreamStalled,
    Unsupported,
)

logger = logging.getLogger(__name__)
R = TypeVar("R")

DEADLINE_SLACK_S = 0.01  # a cancellation this close to the client's deadline is the deadline (DEADLINE_EXCEEDED)

_CODES = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    MessageTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    EngineUnavailable: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    NotFound: grpc.StatusCode.NOT_FOUND,
    StreamStalled: grpc.StatusCode.ABORTED,
    Unsupported: grpc.StatusCode.UNIMPLEMENTED,
    OutOfRange: grpc.StatusCode.OUT_OF_RANGE,
    DataLoss: grpc.StatusCode.DATA_LOSS,
}


def status_for(exc: BaseException, request_id: str | None, tokens_sent: int = 0) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client sees for an exception (never the text of an unexpected one)."""
    for kind, code in _CODES.items():
        if isinstance(exc, kind):
            return code, str(exc)
    if isinstance(exc, ServerShutdown):
        if tokens_sent == 0:  # nothing was streamed: safe to retry on another replica
            return grpc.StatusCode.UNAVAILABLE, f"{exc} (request id {request_id})"
        return grpc.StatusCode.ABORTED, f"{exc} after {tokens_sent} tokens (request id {request_id})"
    if isinstance(exc, EngineError) and tokens_sent == 0:
        return (
            grpc.StatusCode.UNAVAILABLE,
            f"engine failed before this request produced output (request id {request_id})",
        )
    logger.error("request %s failed", request_id, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error (request id {request_id})"


def unary_errors(handler: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    """Decorate a unary grpc.aio handler (self, request, context): any exception it raises ends the RPC with
    the code status_for() gives (streaming handlers, which also count what they sent, call status_for)."""

    @functools.wraps(handler)
    async def wrapped(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            return await handler(self, request, context)
        except Exception as exc:
            code, message = status_for(exc, None)
            await context.abort(code, message)
            raise  # unreachable: abort() raises

    return wrapped
