"""TensorRT-LLM's KV-cache events (Executor.get_kv_cache_event_manager().get_latest_events(timeout_ms), enabled by
KvCacheConfig(event_buffer_max_size=N)) as ours (service/kv_events.py).

The event classes, from the 1.2-era nanobind bindings (NVIDIA/TensorRT-LLM
cpp/tensorrt_llm/nanobind/executor/bindings.cpp @ a35c38f3, the commit trtllm_surface_1.2.json cites), in
bindings.executor.kv_cache: KVCacheEvent(event_id, data, window_size, attention_dp_rank), where `data` is one of
KVCacheCreatedData(num_blocks_per_cache_level), KVCacheStoredData(parent_hash, blocks: [KVCacheStoredBlockData(
block_hash, tokens: [UniqueToken(token_id, token_extra_id)], lora_id, cache_level, priority)]),
KVCacheRemovedData(block_hashes) and KVCacheUpdatedData(block_hash, cache_level, priority). A variant reaches
Python as an object of one of those classes, so `data` is told apart by its class name.

- Created (the pool came up empty) -> AllBlocksCleared; Stored -> BlockStored, the chain's blocks that are full
  (a partial block, which partial reuse may store, names no prefix a router can match: left out with the rest of
  its chain); Removed -> BlockRemoved; Updated (a block moved between GPU and host memory, or its priority
  changed: still cached) -> nothing.
- Hashes are uint64 in TensorRT-LLM: published as the int64 with the same bits.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from service.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

U64 = 1 << 64


def to_int64(value: int) -> int:
    value %= U64
    return value - U64 if value >= 1 << 63 else value


def convert(events: Iterable[Any], block_size: int) -> list[KvEvent]:
    out: list[KvEvent] = []
    for event in events:
        data = event.data
        kind = type(data).__name__
        if kind == "KVCacheCreatedData":
            out.append(AllBlocksCleared())
        elif kind == "KVCacheStoredData":
            stored = _stored(data, block_size)
            if stored is not None:
                out.append(stored)
        elif kind == "KVCacheRemovedData":
            if data.block_hashes:
                out.append(BlockRemoved(tuple(to_int64(h) for h in data.block_hashes)))
        elif kind != "KVCacheUpdatedData":
            raise ValueError(f"unknown TensorRT-LLM KV cache event data {kind}")
    return out


def _stored(data: Any, block_size: int) -> BlockStored | None:
    hashes: list[int] = []
    tokens: list[int] = []
    for block in data.blocks:
        ids = [t.token_id for t in block.tokens]
        if len(ids) != block_size:
            break
        hashes.append(to_int64(block.block_hash))
        tokens += ids
    if not hashes:
        return None
    parent = None if data.parent_hash is None else to_int64(data.parent_hash)
    return BlockStored(tuple(hashes), parent, tuple(tokens), block_size)
