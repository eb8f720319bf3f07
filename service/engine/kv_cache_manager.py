"""Per-request block tables on top of the BlockPool, with prefix caching through chained block hashes."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from service.engine.block_pool import BlockPool, KVBlock
from service.kv_events import BlockStored, event_hash
from service.request import Request


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chained hash of a full block: it identifies the block's tokens *and* every token before them."""
    h = hashlib.blake2b(parent_hash or b"root", digest_size=16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def salt_root(cache_salt: str) -> bytes | None:
    """The parent hash of a request's first block: None (the shared root) without a salt, else one of the salt's
    own, so that requests under different salts never have a block hash in common (vLLM's cache_salt)."""
    if not cache_salt:
        return None
    return hashlib.blake2b(cache_salt.encode(), digest_size=16, person=b"cache_salt").digest()


def salt_tag(cache_salt: str) -> str:
    """What KV events say about a salt: an opaque tag of its root hash (never the salt itself); "" unsalted."""
    root = salt_root(cache_salt)
    return root.hex()[:16] if root is not None else ""


class KVCacheManager:
    """Gives requests KV slots; "does not fit" is a None, never an exception."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_hashes: dict[str, list[bytes]] = {}  # chained hashes of the request's full blocks

    def _hashes(self, req: Request, num_tokens: int) -> list[bytes]:
        """Hashes of the full blocks among the request's first num_tokens tokens (computed once each)."""
        hashes = self.req_hashes.setdefault(req.request_id, [])
        bs = self.block_size
        while (len(hashes) + 1) * bs <= num_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else salt_root(req.cache_salt)
            hashes.append(hash_block_tokens(parent, req.all_token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of a request about to start: (blocks, number of tokens they hold).

        At most num_tokens - 1 tokens are reused so the last token is always computed (its logits are needed).
        """
        if not self.pool.enable_caching:
            return [], 0
        hashes = self._hashes(req, req.num_tokens - 1)
        blocks = []
        for block_hash in hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self, req: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVBlock] = ()
    ) -> list[KVBlock] | None:
        """Make room for num_new_tokens more tokens of `req` (after `new_computed_blocks` from the prefix cache).

        Returns the newly allocated blocks, or None (changing nothing) when the pool cannot supply them.
        """
        blocks = self.req_blocks.get(req.request_id, [])
        num_computed = req.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_needed = -(-total // self.block_size) - len(blocks) - len(new_computed_blocks)
        # cache hits that sit in the free queue stop being free once touched
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_needed, 0) + num_free_hits > self.pool.num_free_blocks:
            return None
        self.pool.touch(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(num_needed, 0))
        blocks = self.req_blocks.setdefault(req.request_id, blocks)
        blocks.extend(new_computed_blocks)
        blocks.extend(new_blocks)
        self._cache_full_blocks(req, blocks, total)
        return new_blocks

    def _cache_full_blocks(self, req: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        # NOTE: blocks are cached as soon as their tokens are scheduled: the runner writes every token's K/V
        # before any attention of the same layer reads, so a request scheduled later in the same step can
        # already read them. Only tokens whose ids are known (num_tokens <= len(all_token_ids)) are hashed.
        if not self.pool.enable_caching:
            return
        hashes = self._hashes(req, min(num_tokens, req.num_tokens))
        run: list[int] = []  # consecutive indices of blocks the cache did not hold before
        for i, (block, block_hash) in enumerate(zip(blocks, hashes, strict=False)):
            if self.pool.cache_block(block, block_hash) and self.pool.events is not None:
                if run and run[-1] != i - 1:
                    self._announce(req, hashes, run)
                    run = []
                run.append(i)
        if run:
            self._announce(req, hashes, run)

    def _announce(self, req: Request, hashes: list[bytes], run: list[int]) -> None:
        """One BlockStored event for a run of newly cached blocks of `req` (their parent: the block before)."""
        first, bs = run[0], self.block_size
        assert self.pool.events is not None
        self.pool.events.append(
            BlockStored(
                block_hashes=tuple(event_hash(hashes[i]) for i in run),
                parent_hash=event_hash(hashes[first - 1]) if first else None,
                token_ids=tuple(req.all_token_ids[first * bs : (run[-1] + 1) * bs]),
                block_size=bs,
                cache_salt=salt_tag(req.cache_salt),
            )
        )

    def trim(self, req: Request) -> None:
        """Free the request's blocks past the ones its computed tokens fill (after speculative drafts were
        rejected: those blocks held only rejected drafts' KV; never cached, as only known tokens are hashed)."""
        blocks = self.req_blocks.get(req.request_id)
        keep = -(-req.num_computed_tokens // self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        extra = blocks[keep:]
        del blocks[keep:]
        self._give_back(extra, 0)

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req_id, ())]

    def free(self, req: Request) -> None:
        """Release the request's blocks (tail first, so its last blocks are the first evicted).

        Blocks past the request's computed tokens were cached when scheduled but never written (the request
        is leaving mid-step, e.g. preempted after being scheduled): their hashes are dropped.
        """
        blocks = self.req_blocks.pop(req.request_id, [])
        self._give_back(blocks, req.num_computed_tokens // self.block_size)
        self.req_hashes.pop(req.request_id, None)

    def _give_back(self, blocks: list[KVBlock], first_unwritten: int) -> None:
        """Free blocks (tail first); those from index first_unwritten on never got their KV written (their hash,
        if any, is dropped where no other request holds them)."""
        for block in blocks[first_unwritten:]:
            if block.ref_cnt == 1:
                self.pool.uncache(block)
        self.pool.free_blocks(reversed(blocks))
