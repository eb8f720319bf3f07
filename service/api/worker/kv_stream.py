"""SubscribeKvEvents: a backend's KvEventLog (service/backends/kv_events.py) streamed the way a gateway (smg)
indexes it (smg-grpc-proto's common.proto: KvEventBatch, KvCacheEvent, EngineLoad, KvSnapshotChunk).

- start_sequence_number 0: every batch ever published when the history still holds them all, else a state
  snapshot (chunks numbered up to the sequence it was taken at: a clear, then every live block, parents first)
  followed by the live batches after it. N > 0: the batches from N on (N itself again, which a subscriber that
  passes its last sequence skips); OUT_OF_RANGE when the history no longer reaches N or N is beyond the last
  batch (this server restarted since), DATA_LOSS when a slow subscriber falls behind the history: both say to
  resubscribe from zero.
- Every event batch carries the engine's load; while no event comes, a `load_only` batch repeating the last
  sequence sent (0 before the first, and only if the subscriber asked for load records before it) when the
  load changed, checked every LOAD_POLL_S, and at least every HEARTBEAT_S.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from smg_grpc_proto.generated import common_pb2 as cpb

from service.backends.base import Backend
from service.backends.kv_events import EventBatch, KvEventLog, LiveBlock
from service.errors import EngineUnavailable
from service.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

SNAPSHOT_BLOCKS_PER_CHUNK = 512
LOAD_POLL_S = 0.25  # how often a change of load is looked for while no event comes (and a drain noticed)
HEARTBEAT_S = 2.0  # a load record at least this often
RATE_WINDOW_S = 10.0  # generation throughput: tokens over about the last this many seconds


def event_proto(event: KvEvent, event_id: int) -> cpb.KvCacheEvent:
    if isinstance(event, BlockStored):
        return cpb.KvCacheEvent(event_id=event_id, stored=_stored(event))
    if isinstance(event, BlockRemoved):
        return cpb.KvCacheEvent(
            event_id=event_id,
            removed=cpb.KvBlocksRemoved(block_hashes=event.block_hashes, tier=cpb.KV_CACHE_TIER_DEVICE),
        )
    assert isinstance(event, AllBlocksCleared)
    return cpb.KvCacheEvent(event_id=event_id, cleared=cpb.KvCacheCleared())


def _stored(e: BlockStored) -> cpb.KvBlocksStored:
    blocks = [cpb.KvBlock(block_hash=h, token_ids=tokens, block_size=e.block_size) for h, _, tokens in e.blocks()]
    stored = cpb.KvBlocksStored(blocks=blocks, tier=cpb.KV_CACHE_TIER_DEVICE, locality=cpb.KV_CACHE_LOCALITY_LOCAL)
    if e.parent_hash is not None:
        stored.parent_block_hash = e.parent_hash
    if e.cache_salt:
        stored.cache_salt = e.cache_salt
    return stored


def batch_proto(batch: EventBatch) -> cpb.KvEventBatch:
    events = [event_proto(e, batch.first_event_id + i) for i, e in enumerate(batch.events)]
    return cpb.KvEventBatch(sequence_number=batch.seq, timestamp=batch.timestamp, events=events)


def snapshot_chunks(seq: int, blocks: list[LiveBlock], block_size: int) -> list[cpb.KvEventBatch]:
    """The live blocks as `count` chunks numbered seq-count+1 .. seq (event ids 0: synthesized)."""
    per_chunk = max(SNAPSHOT_BLOCKS_PER_CHUNK, -(-len(blocks) // max(seq, 1)))  # no number below 1
    count = max(1, -(-len(blocks) // per_chunk))
    now = time.time()
    chunks = []
    for index in range(count):
        events = [cpb.KvCacheEvent(event_id=0, cleared=cpb.KvCacheCleared())] if index == 0 else []
        for b in blocks[index * per_chunk : (index + 1) * per_chunk]:
            stored = BlockStored((b.block_hash,), b.parent_hash, b.token_ids, block_size, b.cache_salt)
            events.append(cpb.KvCacheEvent(event_id=0, stored=_stored(stored)))
        chunk = cpb.KvSnapshotChunk(index=index, count=count, blocks=len(blocks), unknown_before=0)
        chunks.append(
            cpb.KvEventBatch(sequence_number=seq - count + 1 + index, timestamp=now, events=events, snapshot=chunk)
        )
    return chunks


class LoadRecords:
    """EngineLoad records of one stream: numbered samples, the generation rate from a token counter."""

    def __init__(self, backend: Backend, generated_tokens: Callable[[], float]) -> None:
        self.backend = backend
        self._tokens = generated_tokens
        self._samples = itertools.count(1)
        self._window: deque[tuple[float, float]] = deque()  # (time, tokens generated so far)

    def key(self) -> tuple[int, int, int]:
        """What a subscriber routes on; a change of it is worth a record."""
        s = self.backend.stats()
        return s.num_running, s.num_waiting, s.kv_blocks_used

    def _rate(self, now: float) -> float:
        self._window.append((now, self._tokens()))
        while len(self._window) > 2 and now - self._window[1][0] >= RATE_WINDOW_S:
            self._window.popleft()
        (t0, n0), (t1, n1) = self._window[0], self._window[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def record(self, full: bool) -> cpb.EngineLoad:
        """The engine's load now; `full` adds the telemetry beyond the routing core (heartbeats, first record)."""
        s, info = self.backend.stats(), self.backend.info
        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        load = cpb.EngineLoad(
            running_requests=s.num_running,
            waiting_requests=s.num_waiting,
            token_usage=usage,
            active_token_usage=usage,  # every block a request holds is in use; free cached blocks are evictable
            gen_throughput=self._rate(time.monotonic()),
            max_running_requests=info.max_batch_size,
            age_ms=0,
            sample=next(self._samples),
        )
        if full and s.kv_blocks_total:
            load.num_used_tokens = s.kv_blocks_used * info.kv_block_size
            load.max_total_num_tokens = s.kv_blocks_total * info.kv_block_size
        return load


def check_cursor(log: KvEventLog, req: cpb.SubscribeKvEventsRequest) -> None:
    """OutOfRange when the subscription cannot start where it asks (a cursor of 0 always can)."""
    if req.start_sequence_number:
        log.batches_from(req.start_sequence_number)


async def subscribe(
    log: KvEventLog, req: cpb.SubscribeKvEventsRequest, loads: LoadRecords, draining: Callable[[], bool]
) -> AsyncIterator[cpb.KvEventBatch]:
    """The stream of one subscription whose cursor check_cursor() accepted (raises DataLoss as the module
    docstring says)."""
    start = req.start_sequence_number
    if start == 0 and not log.complete():
        seq, blocks = log.snapshot()
        chunks = snapshot_chunks(seq, blocks, log.block_size)
        cursor = seq
        for chunk in chunks:
            if chunk is chunks[-1]:
                chunk.load.CopyFrom(loads.record(full=True))
            yield chunk
        sent = seq
    else:
        cursor = (start or log.first_ever) - 1  # the batch before the first one to send
        sent = start  # the last sequence number this stream sent: a resuming subscriber has its cursor (0: none)
    full = True  # the stream's first record carries the whole telemetry
    last_key, last_record = None, -HEARTBEAT_S
    while not draining():
        batches = log.next_batches(cursor)
        for batch in batches:
            msg = batch_proto(batch)
            msg.load.CopyFrom(loads.record(full))
            full = False
            yield msg
            cursor = sent = batch.seq
        now = time.monotonic()
        if batches:
            last_key, last_record = loads.key(), now
            continue
        heartbeat, key = now - last_record >= HEARTBEAT_S, loads.key()
        if (sent or req.load_records_before_first_batch) and (heartbeat or key != last_key):
            record = loads.record(full or heartbeat)
            record.load_only = True
            full = False
            last_key, last_record = key, now
            yield cpb.KvEventBatch(sequence_number=sent, timestamp=time.time(), load=record)
        await log.wait(cursor, LOAD_POLL_S)
    raise EngineUnavailable("the server is shutting down: resubscribe to another worker")
