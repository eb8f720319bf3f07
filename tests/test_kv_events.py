"""KV-cache events: what the block pool records (service/kv_events.py), the numbered log with its history
and snapshots (service/backends/kv_events.py), and TensorRT-LLM's events read as ours (trtllm_kv_events.py)."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from service.backends.kv_events import KvEventLog
from service.backends.trtllm_kv_events import convert, to_int64
from service.engine.block_pool import BlockPool
from service.engine.kv_cache_manager import KVCacheManager, hash_block_tokens, salt_root
from service.errors import DataLoss, OutOfRange
from service.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, event_hash
from service.request import RequestStatus
from tests.factories import make_request, make_scheduler, run_step
from tests.trtllm_double.kv_events import EVENT_TYPES, KVCacheEventManagerDouble

BS = 4


def _manager(num_blocks: int = 8) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, record_events=True), BS)


def _chain(tokens: list[int], salt: str = "") -> list[int]:
    """The published hashes of the full blocks of `tokens`."""
    out, parent = [], salt_root(salt)
    for i in range(len(tokens) // BS):
        parent = hash_block_tokens(parent, tokens[i * BS : (i + 1) * BS])
        out.append(event_hash(parent))
    return out


def test_a_prompt_stores_its_full_blocks_as_one_chain() -> None:
    kv = _manager()
    req = make_request("a", 10)
    kv.allocate_slots(req, 10)
    (event,) = kv.pool.take_events()
    assert event == BlockStored(tuple(_chain(req.all_token_ids)), None, tuple(req.all_token_ids[:8]), BS)
    assert kv.pool.take_events() == []  # taken once


def test_a_shared_prefix_stores_only_the_new_blocks_under_their_parent() -> None:
    kv = _manager()
    a = make_request("a", list(range(1, 9)))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.pool.take_events()
    b = make_request("b", list(range(1, 9)) + [50, 51, 52, 53, 54])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    kv.allocate_slots(b, 5, hits)
    hashes = _chain(b.all_token_ids)
    assert kv.pool.take_events() == [BlockStored((hashes[2],), hashes[1], (50, 51, 52, 53), BS)]


def test_evictions_are_one_removal_and_a_reset_a_clear() -> None:
    kv = _manager(num_blocks=4)
    a = make_request("a", 16)
    kv.allocate_slots(a, 16)
    a.num_computed_tokens = 16
    kv.free(a)
    stored = kv.pool.take_events()[0].block_hashes
    b = make_request("b", 12)
    kv.allocate_slots(b, 12)  # takes the three least recently freed blocks: a's last three
    removed, _ = kv.pool.take_events()
    assert removed == BlockRemoved(tuple(reversed(stored[1:])))
    b.num_computed_tokens = 12
    kv.free(b)
    assert kv.pool.reset_prefix_cache()
    assert kv.pool.take_events() == [AllBlocksCleared()]


def test_salted_blocks_carry_a_tag_never_the_salt() -> None:
    kv = _manager()
    req = make_request("a", 8, cache_salt="tenant-secret")
    kv.allocate_slots(req, 8)
    (event,) = kv.pool.take_events()
    assert event.block_hashes == tuple(_chain(req.all_token_ids, "tenant-secret"))
    assert event.parent_hash is None and event.cache_salt and "tenant" not in event.cache_salt
    assert event.block_hashes != tuple(_chain(req.all_token_ids))


def test_no_events_unless_asked() -> None:
    kv = KVCacheManager(BlockPool(8), BS)
    kv.allocate_slots(make_request("a", 8), 8)
    assert kv.pool.events is None and kv.pool.take_events() == []


@pytest.mark.parametrize("seed", range(3))
def test_the_events_replay_to_exactly_the_pools_cache(seed: int) -> None:
    """A random workload (shared prefixes, evictions, aborts): the log fed with every event holds
    exactly the block hashes the pool's cache holds, after every step."""
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=12, block_size=BS, max_num_batched_tokens=16)
    pool = sched.kv.pool
    pool.events = []
    log = KvEventLog(10_000, BS)
    prefixes = [[rng.randrange(100, 200) for _ in range(8)] for _ in range(3)]
    for step in range(120):
        if rng.random() < 0.3:
            tail = [rng.randrange(300, 400) for _ in range(rng.randrange(1, 9))]
            sched.add_request(make_request(f"r{step}", rng.choice(prefixes) + tail, max_tokens=rng.randrange(1, 8)))
        if rng.random() < 0.05 and sched.requests:
            for req in sched.finish_requests([rng.choice(list(sched.requests))], RequestStatus.FINISHED_ABORTED):
                sched.release(req)
        run_step(sched)
        log.publish(pool.take_events())
        _, live = log.snapshot()
        assert {b.block_hash for b in live} <= {event_hash(h) for h in pool.cached}
        assert log.live_block_hashes() == {event_hash(h) for h in pool.cached}
    assert pool.num_evictions > 0, "the workload should evict"


def test_sequence_numbers_history_and_cursor_errors() -> None:
    log = KvEventLog(history=3, block_size=BS)
    assert log.publish([]) is None  # nothing to say: no batch
    seqs = [log.publish([BlockRemoved((i,))]) for i in range(5)]
    assert seqs == list(range(log.first_ever, log.first_ever + 5))
    assert [b.seq for b in log.batches_from(seqs[2])] == seqs[2:]
    assert [b.events[0].block_hashes for b in log.next_batches(seqs[3])] == [(4,)]
    assert log.batches_from(seqs[-1] + 1) == []  # caught up
    assert [b.first_event_id for b in log.batches_from(seqs[2])] == [3, 4, 5]
    with pytest.raises(OutOfRange, match=r"before the history.*resubscribe from zero"):
        log.batches_from(seqs[1])
    with pytest.raises(OutOfRange, match=r"beyond the last sequence.*restarted"):
        log.batches_from(seqs[-1] + 2)
    with pytest.raises(DataLoss, match=r"fell behind.*--kv-event-history"):
        log.next_batches(seqs[0])
    assert not log.complete() and KvEventLog(3, BS).complete()


def test_a_later_log_numbers_above_an_earlier_one() -> None:
    """A restarted server's numbers start above any its previous life reached (clock microseconds)."""
    first = KvEventLog(10, BS)
    last = [first.publish([AllBlocksCleared()]) for _ in range(100)][-1]
    assert KvEventLog(10, BS).first_ever > last


def test_snapshot_lists_live_blocks_parents_first_and_leaves_orphans_out() -> None:
    log = KvEventLog(10, BS)
    t = tuple(range(4))
    log.publish([BlockStored((1, 2, 3), None, t * 3, BS), BlockStored((10,), None, t, BS)])
    log.publish([BlockStored((4,), 3, t, BS), BlockRemoved((1,)), BlockStored((1,), None, t, BS)])  # 1 again
    seq, live = log.snapshot()
    order = [b.block_hash for b in live]
    assert seq == log.last_seq and set(order) == {1, 2, 3, 4, 10}
    assert all(order.index(b.parent_hash) < order.index(b.block_hash) for b in live if b.parent_hash is not None)
    log.publish([BlockRemoved((2,))])
    assert {b.block_hash for b in log.snapshot()[1]} == {1, 10}  # 3 and 4 hang off the removed 2
    log.publish([BlockStored((7,), 8, t, BS), BlockStored((8,), 7, t, BS)])  # a cycle never loops
    assert {b.block_hash for b in log.snapshot()[1]} == {1, 10}
    log.publish([AllBlocksCleared()])
    assert log.snapshot()[1] == []


def test_wait_wakes_when_another_thread_publishes() -> None:
    log = KvEventLog(10, BS)

    async def main() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        threading.Timer(0.05, log.publish, ([AllBlocksCleared()],)).start()
        await log.wait(log.last_seq, timeout=60)
        return loop.time() - start

    assert asyncio.run(main()) < 30  # woken by the publish, not by the timeout


def test_trtllm_events_read_as_ours() -> None:
    t = EVENT_TYPES
    manager = KVCacheEventManagerDouble.create(max_size=100, num_blocks=8)
    tokens = tuple(range(10, 18))
    manager.publish([BlockStored((-5, 7), None, tokens, BS), BlockRemoved((-5,))])
    raw = manager.get_latest_events()
    partial = t["KVCacheStoredBlockData"](
        block_hash=9, tokens=[t["UniqueToken"](token_id=1, token_extra_id=0)], lora_id=None, cache_level=0, priority=35
    )
    raw.append(
        t["KVCacheEvent"](
            event_id=99, data=t["KVCacheStoredData"](parent_hash=2**64 - 1, blocks=[partial]), window_size=0,
            attention_dp_rank=None,
        )
    )  # fmt: skip
    raw.append(t["KVCacheEvent"](
        event_id=100, data=t["KVCacheUpdatedData"](block_hash=7, cache_level=None, priority=None), window_size=0,
        attention_dp_rank=None,
    ))  # fmt: skip
    assert convert(raw, BS) == [
        AllBlocksCleared(),  # KVCacheCreatedData: the pool came up empty
        BlockStored((-5, 7), None, tokens, BS),
        BlockRemoved((-5,)),
    ]  # the partial block is left out, the update (still cached) says nothing
    assert to_int64(2**64 - 1) == -1 and to_int64(2**63) == -(2**63) and to_int64(5) == 5
    bogus = t["KVCacheEvent"](event_id=1, data=object(), window_size=0, attention_dp_rank=None)
    with pytest.raises(ValueError, match="unknown TensorRT-LLM KV cache event"):
        convert([bogus], BS)


def test_an_engine_reset_keeps_the_events_not_taken_and_clears(tiny_engine_dir) -> None:
    from service.engine.core import EngineCore
    from service.request import GenerateRequest, SamplingParams

    core = EngineCore(tiny_engine_dir, num_kv_blocks=32, kv_events=True)
    core.generate([GenerateRequest("a", list(range(3, 40)), SamplingParams(max_tokens=2, temperature=0))])
    core.reset()  # as after a failed step with --on-engine-error recover
    events = core.take_kv_events()
    assert isinstance(events[0], BlockStored) and events[-1] == AllBlocksCleared()
    assert EngineCore(tiny_engine_dir, num_kv_blocks=32).take_kv_events() == []  # off unless asked
