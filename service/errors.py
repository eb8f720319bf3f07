"""Exceptions -> gRPC status codes, in one place."""

from __future__ import annotations

import logging

import grpc

from service.async_engine import EngineError, EngineUnavailable, QueueFull
from service.request import InvalidRequest

logger = logging.getLogger(__name__)


class DeadlineExceeded(Exception):
    """The client's deadline had already passed when the request arrived."""


def status_for(exc: BaseException, request_id: str | None, tokens_sent: int = 0) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client sees for an exception (never the text of an unexpected one)."""
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, EngineUnavailable):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, DeadlineExceeded):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
    if isinstance(exc, EngineError) and tokens_sent == 0:
        # nothing was streamed yet: safe for the client to retry elsewhere
        return (
            grpc.StatusCode.UNAVAILABLE,
            f"engine failed before this request produced output (request id {request_id})",
        )
    logger.error("request %s failed", request_id, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error (request id {request_id})"
