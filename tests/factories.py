"""Small factories for scheduler-level tests (no model, no numpy): vLLM tests/v1/core style."""

from __future__ import annotations

import itertools

from service.engine.block_pool import BlockPool
from service.engine.kv_cache_manager import KVCacheManager
from service.engine.scheduler import Scheduler
from service.engine.scheduler_config import SchedulerConfig
from service.request import Request, SamplingParams

_clock = itertools.count()
_prompt_base = itertools.count(1)


def fake_clock() -> float:
    return float(next(_clock))


def make_request(
    request_id: str,
    prompt: list[int] | int,
    max_tokens: int = 8,
    priority: int = 0,
    arrival: float | None = None,
    cache_salt: str = "",
    **sampling: object,
) -> Request:
    # an int prompt gets tokens no other request shares (so no accidental prefix-cache hits)
    base = 1000 * next(_prompt_base)
    ids = list(range(base, base + prompt)) if isinstance(prompt, int) else list(prompt)
    return Request(
        request_id,
        ids,
        SamplingParams(max_tokens=max_tokens, temperature=0, **sampling),
        arrival_time=fake_clock() if arrival is None else arrival,
        priority=priority,
        eos_token_ids=frozenset({2}),
        cache_salt=cache_salt,
    )


def make_scheduler(
    num_blocks: int = 16,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 16,
    max_seq_len: int = 64,
    enable_prefix_caching: bool = True,
    max_bypass: int = 2,
    long_prefill_token_threshold: int = 0,
    attention_cost_per_key: float = 0.0,
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_seq_len=max_seq_len,
        block_size=block_size,
        num_kv_blocks=num_blocks,
        enable_prefix_caching=enable_prefix_caching,
        max_bypass=max_bypass,
        long_prefill_token_threshold=long_prefill_token_threshold,
        attention_cost_per_key=attention_cost_per_key,
    )
    return Scheduler(cfg, KVCacheManager(BlockPool(num_blocks, enable_prefix_caching), block_size), fake_clock)


def run_step(sched: Scheduler, token: int = 7):
    """One scheduler step with a fake model that always samples `token`; invariants checked after it."""
    out = sched.schedule()
    sampled = {s.req_id: [token] for s in out.scheduled if s.sample}
    updated = sched.update_from_output(out, sampled)
    for req, _ in updated:
        if req.is_finished:
            sched.release(req)
    sched.check_invariants()
    return out
