"""The exceptions a request can end with, grpc-free (service/status.py maps them to status codes, in one place).

Raised by validation, admission and the backends; the API edge turns each into one gRPC status code.
"""

from __future__ import annotations


class BackendLoadError(ValueError):
    """The backend cannot start: a dependency is missing, or the engine does not suit it (one line, exit 2)."""


class InvalidRequest(ValueError):
    """A request field is out of range; the message names the field and the limit (INVALID_ARGUMENT)."""


class Overloaded(Exception):
    """Too much work in flight: retry later with backoff (RESOURCE_EXHAUSTED)."""


class QueueFull(Overloaded):
    """The waiting queue is at its bound (RESOURCE_EXHAUSTED)."""


class MessageTooLarge(Exception):
    """A request message is larger than --max-message-bytes (RESOURCE_EXHAUSTED, as gRPC's own limit)."""


class EngineUnavailable(Exception):
    """The backend is starting, draining, stopped or dead (UNAVAILABLE)."""


class EngineError(Exception):
    """The engine failed while this request was in flight (INTERNAL; UNAVAILABLE if nothing was streamed)."""


class DeadlineExceeded(Exception):
    """The client's deadline had passed before the request could be queued (DEADLINE_EXCEEDED)."""


class NotFound(Exception):
    """The request names something this server does not have (a Triton model or version) (NOT_FOUND)."""


class Unsupported(Exception):
    """The server has the thing asked for but does not do this with it (UNIMPLEMENTED), e.g. ModelInfer on a
    decoupled Triton model."""


class StreamStalled(Exception):
    """The stream's client took no response for --stream-stall-timeout seconds: the stream was ended (ABORTED)."""


class ServerShutdown(Exception):
    """The drain timeout ended the request (UNAVAILABLE before any output, ABORTED after some)."""


class OutOfRange(Exception):
    """A cursor outside what the server holds, e.g. a KV-event sequence number its history no longer reaches
    (OUT_OF_RANGE)."""


class DataLoss(Exception):
    """The server dropped what this stream still needed, e.g. a KV-event subscriber fell behind the history
    (DATA_LOSS)."""
