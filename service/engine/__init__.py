"""The native engine, synchronous: scheduler, KV cache manager, block pool, sampler, model runners and EngineCore
(service/backends/native.py runs it in a thread of its own)."""
