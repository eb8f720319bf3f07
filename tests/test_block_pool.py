"""BlockPool and KVCacheManager: exact block ids, reference counts, eviction order, prefix hits."""

from __future__ import annotations

import pytest

from service.engine.block_pool import BlockPool
from service.engine.kv_cache_manager import KVCacheManager, hash_block_tokens, salt_root
from tests.factories import make_request


def test_allocation_and_free_order() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.free_queue.block_ids() == [3, 4]
    pool.free_blocks(reversed(blocks))  # a request frees tail first
    assert pool.free_queue.block_ids() == [3, 4, 2, 1, 0]
    assert [b.block_id for b in pool.get_new_blocks(3)] == [3, 4, 2]
    with pytest.raises(ValueError, match="Cannot get 3 free blocks"):
        pool.get_new_blocks(3)


def test_double_free_is_caught() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([block])


def test_cached_block_survives_free_until_evicted() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"h-a")
    pool.free_blocks([b, a])
    assert pool.free_queue.block_ids() == [2, 1, 0]
    assert pool.get_cached_block(b"h-a") is a  # still cached while free
    pool.touch([a])  # a hit takes it off the free queue
    assert a.ref_cnt == 1 and pool.free_queue.block_ids() == [2, 1]
    pool.free_blocks([a])
    assert pool.free_queue.block_ids() == [2, 1, 0]
    new = pool.get_new_blocks(3)  # reusing block 0 evicts its cached content
    assert [x.block_id for x in new] == [2, 1, 0]
    assert pool.get_cached_block(b"h-a") is None and a.block_hash is None and pool.num_evictions == 1


def test_chained_hash_depends_on_the_whole_prefix() -> None:
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(hash_block_tokens(None, [9, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4]) == h1


def test_salt_roots_are_their_own_chains() -> None:
    assert salt_root("") is None  # no salt: today's shared root
    assert salt_root("a") == salt_root("a") != salt_root("b")
    tokens = [1, 2, 3, 4]
    assert len({hash_block_tokens(None, tokens), hash_block_tokens(salt_root("a"), tokens),
                hash_block_tokens(salt_root("b"), tokens)}) == 3  # fmt: skip


def _manager(num_blocks: int = 10, block_size: int = 4, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, caching), block_size)


def test_allocate_slots_exact_ids_and_none_on_exhaustion() -> None:
    kv = _manager(num_blocks=4)
    a, b = make_request("a", 9), make_request("b", 9)
    assert [x.block_id for x in kv.allocate_slots(a, 9)] == [0, 1, 2]
    a.num_computed_tokens = 9
    assert kv.allocate_slots(b, 9) is None  # needs 3, only 1 free: nothing changes
    assert kv.pool.num_free_blocks == 1 and "b" not in kv.req_blocks
    assert kv.allocate_slots(a, 3) == []  # 9 + 3 = 12 tokens still fit in 3 blocks
    a.num_computed_tokens = 12
    assert [x.block_id for x in kv.allocate_slots(a, 1)] == [3]
    kv.free(a)
    assert kv.pool.free_queue.block_ids() == [3, 2, 1, 0]


def test_prefix_hit_shares_blocks_and_recomputes_last_token() -> None:
    kv = _manager()
    prompt = list(range(12))  # exactly 3 full blocks
    a = make_request("a", prompt)
    kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    b = make_request("b", prompt)
    blocks, num_cached = kv.get_computed_blocks(b)
    assert [x.block_id for x in blocks] == [0, 1] and num_cached == 8  # capped at 11 tokens -> 2 blocks
    new = kv.allocate_slots(b, 4, blocks)
    assert [x.block_id for x in new] == [3]
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    c = make_request("c", prompt[:8] + [99, 98, 97, 96, 95])  # shares two blocks, then diverges
    blocks, num_cached = kv.get_computed_blocks(c)
    assert [x.block_id for x in blocks] == [0, 1] and num_cached == 8


def test_freed_request_blocks_are_reused_by_prefix_then_evicted_tail_first() -> None:
    kv = _manager(num_blocks=4)
    a = make_request("a", list(range(16)))
    kv.allocate_slots(a, 16)
    a.num_computed_tokens = 16
    kv.free(a)
    assert kv.pool.free_queue.block_ids() == [3, 2, 1, 0]  # tail first: block 3 evicted first
    b = make_request("b", list(range(8)) + [50] * 8)
    blocks, num_cached = kv.get_computed_blocks(b)
    assert [x.block_id for x in blocks] == [0, 1] and num_cached == 8
    assert [x.block_id for x in kv.allocate_slots(b, 8, blocks)] == [3, 2]
    assert kv.pool.free_queue.block_ids() == []


def test_blocks_scheduled_but_not_computed_are_not_left_cached() -> None:
    kv = _manager()
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)  # scheduled; hashes recorded for both full blocks
    assert len(kv.pool.cached) == 2
    kv.free(a)  # leaves mid-step (e.g. preempted) with nothing computed
    assert kv.pool.cached == {}


def test_no_prefix_caching() -> None:
    kv = _manager(caching=False)
    a = make_request("a", list(range(12)))
    kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    assert kv.get_computed_blocks(make_request("b", list(range(12)))) == ([], 0)


def _cached_prefix(kv: KVCacheManager, req_id: str, prompt: list[int], salt: str = "") -> list[int]:
    blocks, _ = kv.get_computed_blocks(make_request(req_id, prompt, cache_salt=salt))
    return [b.block_id for b in blocks]


def test_prefix_blocks_are_shared_only_under_the_same_salt() -> None:
    kv = _manager()
    prompt = list(range(12))  # 3 full blocks; a lookup reuses at most 2 (the last token is recomputed)
    a = make_request("a", prompt, cache_salt="tenant-a")
    kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    assert _cached_prefix(kv, "b", prompt, "tenant-b") == []  # same tokens, another salt: no block in common
    assert _cached_prefix(kv, "c", prompt) == []  # nor without a salt
    assert _cached_prefix(kv, "d", prompt, "tenant-a") == [0, 1]  # the same salt shares
    u = make_request("u", prompt)  # unsalted requests share among themselves, as before
    new = kv.allocate_slots(u, 12)
    assert [x.block_id for x in new] == [3, 4, 5] and kv.pool.num_free_blocks == 4
    u.num_computed_tokens = 12
    assert _cached_prefix(kv, "v", prompt) == [3, 4]
    assert _cached_prefix(kv, "w", prompt, "tenant-a") == [0, 1]
    assert [kv.pool.blocks[i].ref_cnt for i in range(6)] == [1, 1, 1, 1, 1, 1]  # lookups took no reference
