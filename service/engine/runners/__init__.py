"""Model runners: execute one forward pass over a flattened batch (native numpy; TensorRT-LLM elsewhere)."""
