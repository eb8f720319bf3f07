"""Compile a model into an engine directory (native numpy engine; TensorRT-LLM in its own backend)."""
