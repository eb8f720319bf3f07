"""The Triton front door: KServe v2 `inference.GRPCInferenceService` with the TensorRT-LLM ensemble contract.

models.py (the model tables), configs.py (ModelConfig / ModelMetadata protos), tensors.py (KServe tensors <->
numpy), convert.py (tensors -> the domain request), servicer.py (the RPCs). tritonclient is imported only here,
lazily from the server (`--triton-port`), so the native path never needs it.
"""
