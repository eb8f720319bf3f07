"""KV-cache events: what the block pool's prefix cache gained and lost, in the form routers index (vLLM's
BlockStored / BlockRemoved / AllBlocksCleared; TensorRT-LLM's KVCacheEventManager publishes the same three).

A block is named by an int64 derived from its chained hash (the hash covers the block's tokens and every token
before them, and the cache salt), so a router can follow parent -> child without hashing anything itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks whose KV the cache now holds, one chain: block i's parent is block i-1, the first one's
    `parent_hash` (None: the first block of a prompt)."""

    block_hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: tuple[int, ...]  # [len(block_hashes) * block_size], in block order
    block_size: int
    cache_salt: str = ""  # an opaque tag of the salt the hashes were computed under; "" unsalted

    def blocks(self) -> Iterator[tuple[int, int | None, tuple[int, ...]]]:
        """Each block as (its hash, its parent's hash, its block_size token ids), in chain order."""
        bs, parent = self.block_size, self.parent_hash
        for i, block_hash in enumerate(self.block_hashes):
            yield block_hash, parent, self.token_ids[i * bs : (i + 1) * bs]
            parent = block_hash


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


def event_hash(block_hash: bytes) -> int:
    """The int64 a block is published under: the first 8 bytes of its 16-byte chained hash, signed."""
    return int.from_bytes(block_hash[:8], "little", signed=True)


def add_removal(events: list[KvEvent], block_hash: int) -> None:
    """Append a removal, merged into the last event when that is a removal too (evictions come in runs)."""
    if events and isinstance(events[-1], BlockRemoved):
        events[-1] = BlockRemoved((*events[-1].block_hashes, block_hash))
    else:
        events.append(BlockRemoved((block_hash,)))
