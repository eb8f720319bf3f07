"""The Triton front door: KServe v2 `inference.GRPCInferenceService` with the TensorRT-LLM ensemble contract.

tensors.py (KServe tensors <-> numpy), convert.py (tensors -> the domain request), servicer.py (the RPCs). The model
tables and the ModelConfig builder it describes its models with are build_engine/triton_models/ (tables.py,
configs.py), shared with the repository generator. tritonclient is imported only here, lazily from the server
(`--triton-port`), so the native path never needs it.
"""
