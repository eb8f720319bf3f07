"""Triton's TensorRT-LLM models (inflight_batcher_llm layout) as build_engine/triton_repo.py writes them.

tables.py: the models' tensor tables (a leaf: no grpc, no tritonclient, no numpy); configs.py: tables -> Triton's
ModelConfig message (tritonclient). The service's Triton front door (service/api/triton/) imports both from here.

preprocessing.py, postprocessing.py: the two Python models of a generated repository, copied as model.py. Each of
those is self-contained (numpy, tokenizers and Triton's triton_python_backend_utils, all in the Triton TensorRT-LLM
container): the repository does not need this package. Their tokenization and detokenization cores are plain
classes, tested without Triton.
"""
