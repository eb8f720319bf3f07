"""trtllm.TrtllmService, TensorRT-LLM's gRPC worker protocol: the door a gateway (smg) drives."""
