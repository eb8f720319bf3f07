"""EngineCore: the one place where the scheduler, the KV cache manager and the model runner meet.

Synchronous and single-threaded: no asyncio, no protobuf. NativeBackend (service/backends/native.py) drives it from a thread;
the offline CLI and the tests drive it directly.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path

from build_engine.spec import EngineConfig, load_engine_config
from service.config import NativeConfig
from service.engine.block_pool import BlockPool
from service.engine.grammar import SUPPORTED_KINDS, GrammarCompiler, GrammarError, MaskFiller
from service.engine.kv_cache_manager import KVCacheManager
from service.engine.output_processor import OutputProcessor
from service.engine.runners.base import ForwardBatch
from service.engine.runners.numpy_runner import NumpyRunner
from service.engine.sampler import Sampler
from service.engine.scheduler import Scheduler
from service.engine.scheduler_config import SchedulerConfig, kv_blocks_for_budget
from service.engine.spec_decode import SpecConfig, Speculator
from service.engine.stats import StepCost
from service.kv_events import AllBlocksCleared, KvEvent
from service.limits import RequestLimits, check_constraint, check_request
from service.request import GenerateRequest, Request, RequestOutput, RequestStatus
from service.telemetry import BackendStats, StepStats
from service.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_MEMORY = NativeConfig().kv_cache_memory  # the one default, in service/config.py
DEFAULT_KV_CACHE_DTYPE = NativeConfig().kv_cache_dtype


class EngineCore:
    last_step: StepStats | None  # statistics of the last step
    last_newly_scheduled: list[str]  # requests the last step scheduled for the first time

    def __init__(
        self,
        engine_dir: str | Path,
        *,
        num_kv_blocks: int | None = None,
        kv_cache_memory: str = DEFAULT_KV_CACHE_MEMORY,
        kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE,
        enable_prefix_caching: bool = True,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        long_prefill_token_threshold: int | None = None,
        sampler_seed: int | None = None,
        kv_events: bool = False,
        speculative: SpecConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine_dir = Path(engine_dir)
        self.kv_events = kv_events and enable_prefix_caching  # record the prefix cache's KV events (take_kv_events)
        self.config: EngineConfig = load_engine_config(engine_dir)
        self.tokenizer = Tokenizer.from_engine_dir(engine_dir)
        bytes_per_block = NumpyRunner.kv_bytes_per_block(self.config, kv_cache_dtype)
        if num_kv_blocks is None:
            num_kv_blocks, budget = kv_blocks_for_budget(self.config, kv_cache_memory, bytes_per_block, max_num_seqs)
            logger.info(
                "KV cache budget %s = %.1f MiB of %s -> %d blocks",
                kv_cache_memory,
                budget / 2**20,
                kv_cache_dtype,
                num_kv_blocks,
            )
        self.sched_cfg = SchedulerConfig.from_engine(
            self.config,
            num_kv_blocks,
            enable_prefix_caching=enable_prefix_caching,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold,
        )
        self.runner = NumpyRunner(
            engine_dir, num_kv_blocks=num_kv_blocks, config=self.config, kv_cache_dtype=kv_cache_dtype
        )
        self.clock = clock
        self.sampler = Sampler(sampler_seed)
        spec = speculative if speculative is not None and speculative.enabled else None
        self.speculator = Speculator(spec) if spec is not None else None  # its verify-cost measurements persist
        self.reset()
        self.cost = StepCost(self.config.arch, self.runner.weight_bytes)
        self.eos_token_ids = frozenset(self.config.tokenizer.eos_token_ids)
        vocab = self.config.arch.vocab_size
        self.grammars = GrammarCompiler(self.engine_dir / "tokenizer.json", vocab, self.eos_token_ids)
        self.masks = MaskFiller(vocab)
        sc = self.sched_cfg
        self.limits = RequestLimits(self.config.arch.vocab_size, sc.max_seq_len, sc.block_size, sc.num_kv_blocks)
        self._steps = itertools.count()

    def reset(self) -> None:
        """A fresh KV pool, scheduler and output state (at start, and after a failed step: the weights stay).

        The runner's KV arrays are not cleared: a block is always written before any attention reads it. KV events
        the old pool recorded and nobody took yet are kept, followed by a clear (its cache is gone).
        """
        sc = self.sched_cfg
        old = getattr(self, "kv", None)
        pending = []
        if old is not None and self.kv_events:
            pending = old.pool.take_events() + ([AllBlocksCleared()] if old.pool.cached else [])
        pool = BlockPool(sc.num_kv_blocks, sc.enable_prefix_caching, record_events=self.kv_events)
        if pool.events is not None:
            pool.events += pending
        self.kv = KVCacheManager(pool, sc.block_size)
        self.scheduler = Scheduler(sc, self.kv, self.clock, self.speculator)
        self.outputs = OutputProcessor(self.tokenizer)
        self.last_step = None
        self.last_newly_scheduled = []

    # ---- requests --------------------------------------------------------------------------------
    def check(self, gen: GenerateRequest) -> None:
        """Raise InvalidRequest if the request is malformed for this model or can never run (the one check)."""
        check_request(gen.prompt_token_ids, gen.sampling, self.limits)
        check_constraint(gen.sampling, SUPPORTED_KINDS, "native")

    def compile(self, gen: GenerateRequest) -> None:
        """Compile the request's constraint, if any (InvalidRequest naming the field if it does not compile);
        cached, so enqueue finds it. Slow the first time (milliseconds to seconds): NativeBackend runs it off
        the event loop."""
        if gen.sampling.constraint is not None:
            self.grammars.compile(gen.sampling.constraint)

    def add_request(self, gen: GenerateRequest, arrival_time: float | None = None) -> Request:
        """Check and queue a request under its own id (offline use; NativeBackend checks, then enqueues)."""
        self.check(gen)
        self.compile(gen)
        return self.enqueue(gen, gen.request_id, arrival_time)

    def enqueue(self, gen: GenerateRequest, req_id: str, arrival_time: float | None = None) -> Request:
        """Queue an already checked request under the engine-side id `req_id` (unique among live requests)."""
        req = Request(
            req_id,
            gen.prompt_token_ids,
            gen.sampling,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            priority=gen.priority,
            eos_token_ids=self.eos_token_ids,
            cache_salt=gen.cache_salt,
        )
        if gen.sampling.constraint is not None:
            req.grammar = self.grammars.state(gen.sampling.constraint)
        self.scheduler.add_request(req)
        self.outputs.add(req)
        return req

    def abort(self, req_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[RequestOutput]:
        """Finish requests in any state (idempotent: unknown or finished ids are ignored)."""
        outputs = []
        for req in self.scheduler.finish_requests(req_ids, status):
            outputs.append(self.outputs.finished_output(req))
            self.scheduler.release(req)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def take_kv_events(self) -> list[KvEvent]:
        """The prefix cache's KV events since the last call (empty unless built with kv_events=True)."""
        return self.kv.pool.take_events()

    def stats(self) -> BackendStats:
        sched = self.scheduler
        return BackendStats(sched.num_running, sched.num_waiting, self.kv.pool.num_used_blocks, sched.cfg.num_kv_blocks)

    # ---- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample, and return the outputs of this step."""
        start = self.clock()
        preempted_before = self.scheduler.num_preemptions
        sched = self.scheduler.schedule()
        self.last_newly_scheduled = sched.newly_scheduled_req_ids
        if sched.is_empty:
            return []
        reqs = [self.scheduler.requests[s.req_id] for s in sched.scheduled if s.sample]
        plain = [r for s, r in zip((s for s in sched.scheduled if s.sample), reqs, strict=True) if not s.num_drafts]
        # masks by row of the plain (non-verify) requests; a constrained verify step's come after the forward
        constrained = [(i, r.grammar) for i, r in enumerate(plain) if r.grammar is not None]
        pending = self.masks.start(constrained) if constrained else None  # filled while the forward pass runs
        forward_start = time.perf_counter()
        logits = self.runner.execute(ForwardBatch.from_scheduler_output(sched, self.sched_cfg.block_size))
        forward_ms = (time.perf_counter() - forward_start) * 1e3
        masks, mask_ms, mask_wait_ms = None, 0.0, 0.0
        if pending is not None:
            wait_start = time.perf_counter()
            masks = pending.result()
            mask_ms, mask_wait_ms = masks.fill_ms, (time.perf_counter() - wait_start) * 1e3
        tokens, logprobs = self._sample(sched, reqs, logits, masks)
        grammars = any(r.grammar is not None for r in reqs)  # verify steps' constrained requests too
        refused = self._advance_grammars(reqs, [tokens[r.request_id] for r in reqs]) if grammars else {}
        outputs = []
        for req, num_new in self.scheduler.update_from_output(sched, tokens):  # every stop decided there
            logprob = logprobs[req.request_id]
            outputs.append(self.outputs.output(req, num_new, logprob[:num_new] if logprob is not None else None))
            if req.is_finished:
                self.scheduler.release(req)
        for out in self.abort(list(refused), RequestStatus.FINISHED_ERROR):
            out.error = refused[out.request_id]
            outputs.append(out)
        preempted = self.scheduler.num_preemptions - preempted_before
        spec = self._spec_counts(sched, tokens, forward_ms) if self.speculator is not None else None
        num_out = sum(map(len, tokens.values()))
        self._record(sched, start, forward_ms, num_out, preempted, (mask_ms, mask_wait_ms), spec)
        return outputs

    def _spec_counts(self, sched, tokens: dict[str, list[int]], forward_ms: float) -> dict:
        """This step's speculative decoding counters (StepStats fields); a single-sequence decode step's forward time
        also goes to the speculator's verify-cost table (by rows: 1 + drafts)."""
        seqs = sched.scheduled
        if len(seqs) == 1 and seqs[0].is_decode:
            self.speculator.cost.observe(1 + seqs[0].num_drafts, forward_ms)
        per_pos: list[int] = []
        drafts = accepted = 0
        for s in seqs:
            if s.num_drafts:
                drafts += 1
                n = len(tokens[s.req_id]) - 1
                accepted += n
                per_pos += [0] * (max(s.num_drafts, len(per_pos)) - len(per_pos))
                for i in range(n):
                    per_pos[i] += 1
        return {
            "num_spec_drafts": drafts,
            "num_spec_draft_tokens": sched.num_draft_tokens,
            "num_spec_accepted_tokens": accepted,
            "spec_accepted_per_pos": tuple(per_pos),
        }

    def _sample(self, sched, reqs: list[Request], logits, masks) -> tuple[dict[str, list[int]], dict[str, list | None]]:
        """The step's new tokens per request id (and their logprobs, or None): one per plain row (sampled as a
        batch), 1 to k + 1 per verify step (its rows checked against its drafts: Sampler.verify)."""
        seqs = [s for s in sched.scheduled if s.sample]
        plain, rows, at = [], [], 0  # plain requests and their rows; verify steps checked one by one
        tokens, logprobs = {}, {}
        for seq, req in zip(seqs, reqs, strict=True):
            n = 1 + seq.num_drafts
            if seq.num_drafts:
                drafts = seq.token_ids[-seq.num_drafts :]
                allowed = self.masks.along(req.grammar, drafts) if req.grammar is not None else None
                out, lps = self.sampler.verify(logits[at : at + n], req, drafts, allowed)
                tokens[req.request_id] = out
                logprobs[req.request_id] = None if req.sampling.logprobs is None else lps
            else:
                plain.append(req)
                rows.append(at)
            at += n
        if plain:  # masks are by row of this plain batch (step()); a verify step's: MaskFiller.along
            sampled = self.sampler.sample(logits if len(rows) == len(logits) else logits[rows], plain, masks)
            for r, t, lp in zip(plain, sampled.token_ids, sampled.logprobs, strict=True):
                tokens[r.request_id] = [t]
                logprobs[r.request_id] = None if lp is None else [lp]
        return tokens, logprobs

    @staticmethod
    def _advance_grammars(reqs: list[Request], token_ids: list[list[int]]) -> dict[str, str]:
        """Advance each constrained request's matcher past its new tokens (a verify step's: the accepted drafts
        and one more); the ids it refused (never, as the masks are applied; a bug otherwise: that request fails
        alone) -> why."""
        refused = {}
        for req, tokens in zip(reqs, token_ids, strict=True):
            if req.grammar is not None:
                try:
                    req.grammar.consume(tokens)
                except GrammarError as exc:
                    logger.error("request %s: %s", req.request_id, exc)
                    refused[req.request_id] = "the output left its constraint's grammar"
        return refused

    def _record(
        self,
        sched,
        start: float,
        forward_ms: float,
        num_sampled: int,
        num_preempted: int,
        mask: tuple[float, float],
        spec: dict | None = None,
    ) -> None:
        flops, moved = self.cost.of(sched)
        self.last_step = StepStats(
            step=next(self._steps),
            num_seqs=len(sched.scheduled),
            num_prefill_tokens=sched.num_prefill_tokens,
            num_decode_tokens=sched.num_decode_tokens,
            num_sampled=num_sampled,
            step_ms=(self.clock() - start) * 1e3,
            forward_ms=forward_ms,
            flops=flops,
            bytes_moved=moved,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_blocks_used=self.kv.pool.num_used_blocks,
            num_preempted=num_preempted,
            mask_ms=mask[0],
            mask_wait_ms=mask[1],
            **(spec or {}),
        )

    def fail_all(self, message: str) -> list[RequestOutput]:
        """After an engine error: finish every request with an error and drop the possibly stale prefix cache."""
        outputs = self.abort(list(self.scheduler.requests), RequestStatus.FINISHED_ERROR)
        for out in outputs:
            out.error = message
        self.kv.pool.reset_prefix_cache()
        return outputs

    def generate(self, requests: list[GenerateRequest]) -> dict[str, list[RequestOutput]]:
        """Run requests to completion (offline use): request_id -> its outputs in order."""
        results: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
        for r in requests:
            self.add_request(r)
        while self.has_unfinished_requests():
            for out in self.step():
                results[out.request_id].append(out)
        return results
