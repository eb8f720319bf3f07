"""How a TensorRT-LLM engine is run (TensorRT-LLM's executor settings, not its build settings): defined once, here.

Two things run an engine of `python -m build_engine --backend trtllm`, and both take these values with these
defaults: the service's trtllm backend (service/config.py `TrtllmConfig` is this dataclass; `python -m service`
flags) and the Triton model repository (build_engine/triton_repo.py writes them into tensorrt_llm/config.pbtxt;
its own flags), so an engine is served the same way by both. They live in build_engine, not service/config.py,
because build_engine imports nothing of service. A leaf module: it imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULER_POLICIES = ("guaranteed_no_evict", "max_utilization")


@dataclass(frozen=True, slots=True)
class TrtllmRuntime:
    kv_cache_free_gpu_memory_fraction: float = 0.9  # of the GPU memory left after the weights (TensorRT-LLM's)
    scheduler_policy: str = "guaranteed_no_evict"  # or max_utilization (may pause requests)
    enable_chunked_context: bool = True
