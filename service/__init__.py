"""The gRPC LLM serving service and its native (numpy) engine."""

import importlib.metadata as _metadata
import os as _os

# gRPC core logs at INFO (e.g. "Got goaway ... Cancelling all calls" when a server stops) unless the
# verbosity is set explicitly; ERROR is its documented default. Set before grpc is first imported.
_os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

PACKAGE = "llm-grpc-serving"


def version() -> str:
    """This package's version, or "unknown" where it runs from a source tree that was never installed (the
    images put the source on PYTHONPATH): servers report it, and must not fail for the lack of it."""
    try:
        return _metadata.version(PACKAGE)
    except _metadata.PackageNotFoundError:
        return "unknown"
