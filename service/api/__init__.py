"""The gRPC edge: server, llm.v1 servicer, validation, status codes, auth, Prometheus metrics."""
