"""The native engine: scheduler, KV cache manager, block pool, sampler, model runners, EngineCore and AsyncEngine."""
