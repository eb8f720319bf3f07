"""Iteration-level scheduler: which requests advance in the next step, and by how many tokens.

There is no prefill or decode phase in the scheduler state: every request has num_computed_tokens and
catches up to num_tokens within a per-step token budget. Running decodes go first, one token each, so every
one of them advances in every step; then running prefills, one chunk each (capped while decodes run, so the
step that carries them stays short; leaving a quarter of the budget to waiting requests while there are
some); then waiting requests in (priority, arrival) order while blocks, budget and the batch cap allow.
When a running request cannot get a block, the lowest-priority, newest running request is preempted by
recompute.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Callable, Iterable

from service.engine.kv_cache_manager import KVCacheManager
from service.engine.scheduler_config import SchedulerConfig
from service.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from service.engine.spec_decode import Speculator
from service.request import Request, RequestStatus
from service.stops import stop_for

logger = logging.getLogger(__name__)

# Share of a step's token budget that running prefills leave to waiting requests (only while some wait).
WAITING_RESERVE_FRACTION = 0.25
_STATUS = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH}


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        kv: KVCacheManager,
        clock: Callable[[], float] = time.monotonic,
        speculator: Speculator | None = None,
    ) -> None:
        self.cfg = cfg
        self.kv = kv
        self.clock = clock
        self.speculator = speculator  # None: no speculative decoding
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by _order_key
        self.running: list[Request] = []  # in admission order (newest last)
        self._order: dict[str, tuple[int, float, int]] = {}
        self._counter = itertools.count()
        self.num_preemptions = 0

    # ---- admission -------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request that was checked on admission (service.limits.check_request); ids are unique."""
        assert req.request_id not in self.requests, f"request id {req.request_id} is already in use"
        self.requests[req.request_id] = req
        self._order[req.request_id] = (req.priority, req.arrival_time, next(self._counter))
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        keys = [self._order[r.request_id] for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, self._order[req.request_id]), req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        # NOTE: while requests wait for a slot, prefill chunks of running requests leave them a share of the
        # budget, so a short request arriving during a long chunked prefill starts in the next step.
        can_admit = self.waiting and len(self.running) < self.cfg.max_num_seqs
        reserve = int(budget * WAITING_RESERVE_FRACTION) if can_admit else 0
        # 1. every running decode gets its token first, whatever prefill was admitted before it (with drafts to
        # verify, where speculation is on and the step has few enough decodes for it to pay)
        decodes = [
            r for r in self.running if r.status == RequestStatus.RUNNING and r.num_tokens - r.num_computed_tokens == 1
        ]
        spec = (
            self.speculator if self.speculator and len(decodes) <= self.speculator.cfg.disable_by_batch_size else None
        )
        for req in decodes:
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted for an earlier decode of this loop
                continue
            drafts = spec.drafts(req, self._draft_room(req, budget - 1)) if spec else []
            budget = self._schedule_running(req, 1 + len(drafts), budget, out, drafts)
        # 2. then prefill (or recompute) chunks, each capped while decodes run: the step stays short
        decoding = bool(out.scheduled)
        for req in list(self.running):
            need = req.num_tokens - req.num_computed_tokens
            if budget <= reserve:
                break
            if req.status != RequestStatus.RUNNING or need <= 1:
                continue
            num_new = self._chunk(req, need, budget - reserve, decoding)
            budget = self._schedule_running(req, num_new, budget, out)
        if not out.preempted_req_ids:  # admitting new work right after preempting would thrash
            self._admit_waiting(out, budget, bool(out.scheduled))
        return out

    def _chunk(self, req: Request, need: int, budget: int, decoding: bool) -> int:
        """Tokens of `req`'s prompt to compute in this step: what is left, the budget, and the cap while decodes
        run (SchedulerConfig.prefill_cap)."""
        cap = self.cfg.prefill_cap(req.num_computed_tokens) if decoding else None
        return min(need, budget, cap or need)

    def _draft_room(self, req: Request, budget: int) -> int:
        """Drafts a decode may carry: the step's budget left, and the tokens max_tokens and max_seq_len leave
        after its next one (a draft past either could never be used)."""
        left = min(req.sampling.max_tokens - len(req.output_token_ids), self.cfg.max_seq_len - req.num_tokens)
        return min(budget, left - 1)

    def _schedule_running(
        self, req: Request, num_new: int, budget: int, out: SchedulerOutput, drafts: list[int] | None = None
    ) -> int:
        """Schedule num_new tokens of a running request (the last of them `drafts`, if any), preempting the
        lowest-priority, newest running requests while the pool cannot give it blocks (it may be the victim
        itself); returns the budget left. Drafts are dropped first when blocks are short."""
        while self.kv.allocate_slots(req, num_new) is None:
            if drafts:  # no room for the drafts: verify none rather than preempt anyone for them
                num_new, drafts = num_new - len(drafts), []
                continue
            victim = max(self.running, key=lambda r: self._order[r.request_id])  # lowest priority, newest
            budget += self._preempt(victim, out)
            if victim is req:
                return budget
        self._schedule_seq(req, num_new, out, drafts or [])
        return budget - num_new

    def _admit_waiting(self, out: SchedulerOutput, budget: int, decoding: bool) -> None:
        j = 0
        while j < len(self.waiting) and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            if j > 0 and self.waiting[0].num_bypassed >= self.cfg.max_bypass:
                break  # the head has been passed over enough: wait until it fits
            req = self.waiting[j]
            computed, num_cached = ([], 0)
            if req.num_computed_tokens == 0:
                computed, num_cached = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_cached, budget)
            if decoding and num_new > 1:  # a new prompt's first chunk is capped too while decodes run
                num_new = min(num_new, self.cfg.prefill_cap(num_cached) or num_new)
            if self.kv.allocate_slots(req, num_new, computed) is None:
                j += 1  # does not fit now: a later (smaller) request may go ahead of it, a bounded number of times
                continue
            self.waiting.pop(j)
            if j > 0:
                self.waiting[0].num_bypassed += 1
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            if req.first_scheduled_time is None:
                req.first_scheduled_time = self.clock()
                req.num_cached_tokens = num_cached
                out.newly_scheduled_req_ids.append(req.request_id)
            self.running.append(req)
            self._schedule_seq(req, num_new, out)
            budget -= num_new

    def _schedule_seq(self, req: Request, num_new: int, out: SchedulerOutput, drafts: list[int] = ()) -> None:
        start = req.num_computed_tokens
        num_known = num_new - len(drafts)  # tokens whose ids are known; the drafts follow them
        is_decode = num_known == 1 and start >= req.num_prompt_tokens
        out.scheduled.append(
            ScheduledSeq(
                req_id=req.request_id,
                token_ids=req.all_token_ids[start : start + num_known] + list(drafts),
                num_computed=start,
                block_ids=self.kv.block_ids(req.request_id),
                sample=start + num_known == req.num_tokens,
                is_decode=is_decode,
                num_drafts=len(drafts),
            )
        )
        out.num_scheduled_tokens[req.request_id] = num_new
        out.total_num_scheduled_tokens += num_new
        if is_decode:
            out.num_decode_tokens += 1
            out.num_draft_tokens += len(drafts)
        else:
            out.num_prefill_tokens += num_new

    def _preempt(self, victim: Request, out: SchedulerOutput) -> int:
        """Preempt by recompute; returns the token budget given back if the victim was already scheduled."""
        self.running.remove(victim)
        self.kv.free(victim)  # before num_computed_tokens is reset: it tells which blocks hold valid KV
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(victim)
        out.preempted_req_ids.append(victim.request_id)
        returned = out.num_scheduled_tokens.pop(victim.request_id, 0)
        if returned:  # it was scheduled earlier in this step (possible with priorities): take it back out
            seq = next(s for s in out.scheduled if s.req_id == victim.request_id)
            out.scheduled.remove(seq)
            out.total_num_scheduled_tokens -= returned
            if seq.is_decode:
                out.num_decode_tokens -= 1
                out.num_draft_tokens -= seq.num_drafts
            else:
                out.num_prefill_tokens -= returned
        logger.debug("preempted %s (%d preemptions so far)", victim.request_id, victim.num_preemptions)
        return returned

    # ---- results ---------------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[tuple[Request, int]]:
        """Apply a step's results: advance computed tokens, append each request's new tokens (its text too) and
        decide every stop rule (service/stops.py) at each, ending the request at the first that stops it. A
        verify step's tokens are its accepted drafts and one more: rejected drafts' KV is rolled back.

        Returns (request, tokens appended) for the requests that got tokens (finished ones included, freed).
        """
        now = self.clock()
        updated = []
        for seq in out.scheduled:
            req = self.requests.get(seq.req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            tokens = sampled.get(seq.req_id)
            if seq.num_drafts:  # a verify step: KV holds its last token and the accepted drafts, no more
                accepted = len(tokens) - 1
                req.num_computed_tokens += 1 + accepted
                self.kv.trim(req)  # blocks that only rejected drafts used go back
            else:
                req.num_computed_tokens += len(seq.token_ids)
            if not tokens:
                continue
            if req.spec:  # the drafter's record: drafts accepted, or its next token against the model's
                req.spec.record(seq.num_drafts, tokens)
            appended = 0
            for token in tokens:
                req.append_token(token, now)
                appended += 1
                text_stop = req.text.push(token) if req.text is not None else None
                stop = stop_for(token, req.sampling, req.eos_token_ids, len(req.output_token_ids), req.num_tokens,
                                self.cfg.max_seq_len, text_stop)  # fmt: skip
                if stop is not None:
                    req.stop_reason = stop.stop_reason
                    self._finish(req, _STATUS[stop.finish_reason], now)
                    break
            updated.append((req, appended))
        return updated

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish requests in any state (abort, stop string, engine error); unknown ids are ignored."""
        now = self.clock()
        finished = []
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None or req.is_finished:
                continue
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            self._finish(req, status, now)
            finished.append(req)
        return finished

    def _finish(self, req: Request, status: RequestStatus, now: float) -> None:
        if req in self.running:
            self.running.remove(req)
        req.status = status
        req.finish_time = now
        self.kv.free(req)

    def release(self, req: Request) -> None:
        """Forget a finished request once its final output has been handed over."""
        assert req.is_finished
        self.requests.pop(req.request_id, None)
        self._order.pop(req.request_id, None)

    # ---- checks ----------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests call this after every step)."""
        pool = self.kv.pool
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        assert all(b.ref_cnt == 0 for b in pool.free_queue._queue.values()), "a free block has references"
        in_use = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert in_use == pool.num_used_blocks, "used blocks and referenced blocks disagree"
        table_entries = sum(len(blocks) for blocks in self.kv.req_blocks.values())
        assert sum(b.ref_cnt for b in pool.blocks) == table_entries, "ref counts do not match block tables"
        for req_id, blocks in self.kv.req_blocks.items():
            assert len({b.block_id for b in blocks}) == len(blocks), f"{req_id} holds a block twice"
            assert self.requests[req_id].status == RequestStatus.RUNNING, f"{req_id} holds blocks but is not running"
        ids_running = {r.request_id for r in self.running}
        ids_waiting = {r.request_id for r in self.waiting}
        assert not ids_running & ids_waiting, "a request is both running and waiting"
        assert len(self.running) <= self.cfg.max_num_seqs
        live = {rid for rid, r in self.requests.items() if not r.is_finished}
        assert live == ids_running | ids_waiting, "a live request is in neither queue"
        if not self.requests:
            assert pool.num_free_blocks == pool.num_blocks, "idle, yet blocks are in use"
