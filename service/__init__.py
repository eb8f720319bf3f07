"""The gRPC LLM serving service and its native (numpy) engine."""

import os as _os

# gRPC core logs at INFO (e.g. "Got goaway ... Cancelling all calls" when a server stops) unless the
# verbosity is set explicitly; ERROR is its documented default. Set before grpc is first imported.
_os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
