"""The gRPC LLM serving service and its native (numpy) engine."""
