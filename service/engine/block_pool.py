"""KV cache blocks: ids, reference counts, an LRU queue of free blocks, and the prefix-cache hash map."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from service.kv_events import AllBlocksCleared, KvEvent, add_removal, event_hash


class KVBlock:
    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set once when the block is full and cached; reset on eviction

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Free blocks in eviction order (least recently freed first), with O(1) removal from the middle.

    An OrderedDict gives the same guarantees as vLLM's intrusive doubly linked list with less code.
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._queue)

    def popleft(self) -> KVBlock:
        return self._queue.popitem(last=False)[1]

    def remove(self, block: KVBlock) -> None:
        del self._queue[block.block_id]

    def append(self, block: KVBlock) -> None:
        self._queue[block.block_id] = block

    def block_ids(self) -> list[int]:
        return list(self._queue)


class BlockPool:
    """Owns every KV block. A block is free when its ref_cnt is 0; a free block may still hold cached KV
    (its hash stays in the map) until it is evicted to serve a new allocation.

    With `record_events`, every change to the map is also recorded as a KV event (kv_events.py) for whoever
    takes them (take_events): the removals here, the stores by the KVCacheManager, which knows the tokens.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, record_events: bool = False) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}  # block hash -> block holding that prefix's KV
        self.num_evictions = 0
        self.events: list[KvEvent] | None = [] if record_events and enable_caching else None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take n free blocks (evicting their cached content); raises if fewer are free (callers check)."""
        if n > len(self.free_queue):
            raise ValueError(f"Cannot get {n} free blocks from the pool ({len(self.free_queue)} free)")
        blocks = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            self.uncache(block)
            self.num_evictions += 1

    def uncache(self, block: KVBlock) -> None:
        """Forget the block's cached content (its hash) without freeing it."""
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            if self.events is not None:
                add_removal(self.events, event_hash(block.block_hash))
        block.block_hash = None

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones off the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVBlock, block_hash: bytes) -> bool:
        """Record that `block` holds the KV of the full block whose chained hash is `block_hash`; True when the
        cache did not hold that hash before (a block to announce)."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        block.block_hash = block_hash
        return self.cached.setdefault(block_hash, block) is block  # the first holder stays canonical

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the given order; blocks reaching 0 join the free queue's
        tail, so pass a request's blocks tail first to have its last blocks evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of block {block.block_id}"
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        if self.cached and self.events is not None:
            self.events.append(AllBlocksCleared())
        self.cached.clear()
        return True

    def take_events(self) -> list[KvEvent]:
        """The KV events recorded since the last call (none unless record_events)."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events
