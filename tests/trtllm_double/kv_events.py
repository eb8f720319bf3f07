"""The TensorRT-LLM double's KV-cache events: bindings.executor.kv_cache.KVCacheEventManager (in the surface JSON:
get_latest_events(timeout_ms)) and the event classes it returns, which the JSON lacks: their names and read-only
attributes are those of NVIDIA/TensorRT-LLM cpp/tensorrt_llm/nanobind/executor/bindings.cpp @ a35c38f3 (the
commit the JSON cites for that file). The events come from the double's engine underneath (its block pool's
events, as TensorRT-LLM's KV cache manager would report the same changes): the pool's first event is
KVCacheCreatedData; hashes are uint64; a block's tokens are UniqueToken(token_id, token_extra_id=0); the buffer
keeps the newest event_buffer_max_size events, as TensorRT-LLM's does.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from service.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from tests.trtllm_double.surface import RECORDER, SurfaceObject

BINDINGS_SOURCE = (
    "NVIDIA/TensorRT-LLM:cpp/tensorrt_llm/nanobind/executor/bindings.cpp@a35c38f32e0ed726a47971fe18ea73a5e5583ca4"
)
# class -> its def_ro attributes, as bound there
EVENT_CLASSES = {
    "KVCacheEvent": ("event_id", "data", "window_size", "attention_dp_rank"),
    "KVCacheCreatedData": ("num_blocks_per_cache_level",),
    "KVCacheStoredData": ("parent_hash", "blocks"),
    "KVCacheStoredBlockData": ("block_hash", "tokens", "lora_id", "cache_level", "priority"),
    "UniqueToken": ("token_id", "token_extra_id"),
    "KVCacheRemovedData": ("block_hashes",),
    "KVCacheUpdatedData": ("block_hash", "cache_level", "priority"),
}


class _ReadOnly:
    __slots__ = ("_values",)

    def __init__(self, **values: Any) -> None:
        if set(values) != set(EVENT_CLASSES[type(self).__name__]):
            raise TypeError(f"{type(self).__name__} takes {EVENT_CLASSES[type(self).__name__]}")
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name: str) -> Any:
        try:
            return object.__getattribute__(self, "_values")[name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__}.{name} is read-only")


EVENT_TYPES: dict[str, type] = {name: type(name, (_ReadOnly,), {"__slots__": ()}) for name in EVENT_CLASSES}
U64 = 1 << 64


class KVCacheEventManagerDouble(SurfaceObject):
    """Generated as bindings.executor.kv_cache.KVCacheEventManager; fed by the double's Executor."""

    def get_latest_events(self, timeout_ms: float | None = None) -> list:
        RECORDER.call("tensorrt_llm.bindings.executor.kv_cache.KVCacheEventManager.get_latest_events", ("timeout_ms",))
        with self._cond:
            if not self._events and timeout_ms:
                self._cond.wait(timeout_ms / 1000)
            out = list(self._events)
            self._events.clear()
        return out

    @classmethod
    def create(cls, max_size: int, num_blocks: int) -> KVCacheEventManagerDouble:
        manager = cls._make()
        object.__setattr__(manager, "_cond", threading.Condition())
        object.__setattr__(manager, "_events", deque(maxlen=max_size))
        object.__setattr__(manager, "_ids", 0)
        manager._add(EVENT_TYPES["KVCacheCreatedData"](num_blocks_per_cache_level=[num_blocks, 0]))
        return manager

    def publish(self, events: list[KvEvent]) -> None:
        """The engine's events, as TensorRT-LLM's event manager reports them."""
        for e in events:
            self._add(_data(e))

    def _add(self, data: Any) -> None:
        with self._cond:
            object.__setattr__(self, "_ids", self._ids + 1)
            self._events.append(
                EVENT_TYPES["KVCacheEvent"](event_id=self._ids, data=data, window_size=0, attention_dp_rank=None)
            )
            self._cond.notify_all()


def _data(e: KvEvent) -> Any:
    t = EVENT_TYPES
    if isinstance(e, BlockStored):
        blocks = [
            t["KVCacheStoredBlockData"](
                block_hash=h % U64,
                tokens=[t["UniqueToken"](token_id=x, token_extra_id=0) for x in tokens],
                lora_id=None,
                cache_level=0,
                priority=35,
            )
            for h, _, tokens in e.blocks()
        ]
        parent = None if e.parent_hash is None else e.parent_hash % U64
        return t["KVCacheStoredData"](parent_hash=parent, blocks=blocks)
    if isinstance(e, BlockRemoved):
        return t["KVCacheRemovedData"](block_hashes=[h % U64 for h in e.block_hashes])
    assert isinstance(e, AllBlocksCleared)
    # TensorRT-LLM has no "cleared": a reset pool is a new one (a new executor's Created event)
    return t["KVCacheCreatedData"](num_blocks_per_cache_level=[0, 0])
