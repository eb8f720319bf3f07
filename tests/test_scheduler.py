"""Scheduler: token budget, chunked prefill, decode-first, preemption, priorities, bounded bypass, aborts.

A fake model samples token 7 for every sequence; invariants are checked after every step (run_step).
"""

from __future__ import annotations

import pytest

from service.errors import InvalidRequest
from service.limits import RequestLimits, check_request
from service.request import RequestStatus, SamplingParams
from tests.factories import make_request, make_scheduler, run_step


def _sched_tokens(out) -> dict[str, int]:
    return dict(out.num_scheduled_tokens)


def test_chunked_prefill_then_decode() -> None:
    s = make_scheduler(max_num_batched_tokens=4)
    s.add_request(make_request("a", 10, max_tokens=3))
    chunks = [_sched_tokens(run_step(s)) for _ in range(3)]
    assert chunks == [{"a": 4}, {"a": 4}, {"a": 2}]  # the last chunk samples the first token
    req = s.requests["a"]
    assert req.output_token_ids == [7] and req.num_computed_tokens == 10
    assert _sched_tokens(run_step(s)) == {"a": 1}
    out = run_step(s)
    assert out.num_decode_tokens == 1 and not s.requests  # 3 tokens: finished (length) and released


def test_running_decodes_go_before_new_prefills() -> None:
    s = make_scheduler(max_num_batched_tokens=6)
    s.add_request(make_request("a", 4, max_tokens=10))
    run_step(s)  # a prefilled
    s.add_request(make_request("b", 20, max_tokens=2))
    out = run_step(s)
    assert [x.req_id for x in out.scheduled] == ["a", "b"]
    assert _sched_tokens(out) == {"a": 1, "b": 5}  # b gets what the decode leaves of the budget
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 5


def test_batch_cap_limits_running_sequences() -> None:
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=32)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 4, max_tokens=4))
    out = run_step(s)
    assert sorted(_sched_tokens(out)) == ["r0", "r1"] and s.num_waiting == 1


def test_preemption_takes_the_newest_and_recomputes() -> None:
    # 6 blocks of 4 tokens; three requests of 7 prompt tokens each need 2 blocks now, 3 once they grow past 8
    s = make_scheduler(num_blocks=6, max_num_batched_tokens=32, max_seq_len=32)
    for i in range(3):
        s.add_request(make_request(f"r{i}", [10 * i + k for k in range(7)], max_tokens=6))
    run_step(s)
    assert s.kv.pool.num_free_blocks == 0
    assert [s.kv.block_ids(f"r{i}") for i in range(3)] == [[0, 1], [2, 3], [4, 5]]
    run_step(s)  # tokens 8: still inside block 2 of each
    out = run_step(s)  # token 9 needs a third block: r0 takes r2's (newest) blocks, then r1 takes the rest
    assert out.preempted_req_ids == ["r2"]
    r2 = s.requests["r2"]
    assert r2.status == RequestStatus.PREEMPTED and r2.num_computed_tokens == 0 and r2.num_preemptions == 1
    assert r2.output_token_ids == [7, 7]  # kept: recomputed as part of the prompt later
    assert s.kv.block_ids("r0") == [0, 1, 5] and s.kv.block_ids("r1") == [2, 3, 4]
    assert [w.request_id for w in s.waiting] == ["r2"]
    for _ in range(20):
        if not s.requests:
            break
        run_step(s)
    assert not s.requests and s.kv.pool.num_free_blocks == 6


def test_preempted_request_is_readmitted_first() -> None:
    s = make_scheduler(num_blocks=4, max_num_batched_tokens=32)
    s.add_request(make_request("old", [1, 3, 5, 7, 9, 11, 13], max_tokens=6))
    s.add_request(make_request("new", [2, 4, 6, 8, 10, 12, 14], max_tokens=6))
    run_step(s)
    run_step(s)
    run_step(s)  # old grows, new is preempted
    s.add_request(make_request("later", 3, max_tokens=1))
    assert [w.request_id for w in s.waiting] == ["new", "later"]  # earlier arrival stays ahead


def test_priority_orders_admission() -> None:
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("low", 4, priority=5))
    s.add_request(make_request("high", 4, priority=-1))
    assert list(_sched_tokens(run_step(s))) == ["high"]


def test_bounded_bypass_then_head_of_line_waits() -> None:
    # the head needs 4 blocks (budget lets it take 16 tokens at once), only 3 are free while "hog" runs
    s = make_scheduler(num_blocks=5, max_num_batched_tokens=16, max_bypass=2)
    s.add_request(make_request("hog", 4, max_tokens=12))
    run_step(s)  # hog holds 2 blocks (prompt + room to grow)
    s.add_request(make_request("big", 16, max_tokens=4))
    for i in range(4):
        s.add_request(make_request(f"small{i}", 1, max_tokens=1))
    out = run_step(s)
    assert "big" not in out.num_scheduled_tokens
    assert {"small0", "small1"} <= set(out.num_scheduled_tokens)  # two bypasses allowed...
    assert "small2" not in out.num_scheduled_tokens  # ...then admission waits for the head
    assert s.waiting[0].request_id == "big" and s.waiting[0].num_bypassed == 2


def test_requests_that_can_never_fit_are_rejected_on_submission() -> None:
    limits = RequestLimits(vocab_size=10**6, max_seq_len=64, kv_block_size=4, num_kv_blocks=4)

    def check(req) -> None:
        check_request(req.prompt_token_ids, req.sampling, limits)

    with pytest.raises(InvalidRequest, match="exceeds max_seq_len 64"):
        check(make_request("long", 60, max_tokens=8))
    with pytest.raises(InvalidRequest, match="more than the whole KV cache"):
        check(make_request("wide", 20, max_tokens=8))  # 7 blocks > 4
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        check(make_request("empty", []))
    with pytest.raises(InvalidRequest, match=r"stopping\.stop_token_ids contains token id 10"):
        check_request([1, 2], SamplingParams(stop_token_ids=(3, 10)), RequestLimits(vocab_size=10, max_seq_len=64))
    check(make_request("fits", 8, max_tokens=8))  # 4 blocks: exactly the pool


def test_abort_in_every_state_frees_everything() -> None:
    s = make_scheduler(num_blocks=8, max_num_batched_tokens=4, max_num_seqs=2)
    s.add_request(make_request("decoding", 3, max_tokens=20))
    run_step(s)
    s.add_request(make_request("prefilling", 12, max_tokens=5))
    s.add_request(make_request("queued", 4, max_tokens=5))
    run_step(s)
    assert s.requests["prefilling"].num_computed_tokens > 0 and s.requests["queued"].status == RequestStatus.WAITING
    finished = s.finish_requests(["decoding", "prefilling", "queued", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in finished} == {"decoding", "prefilling", "queued"}
    assert s.finish_requests(["decoding"], RequestStatus.FINISHED_ABORTED) == []  # idempotent
    for r in finished:
        s.release(r)
    s.check_invariants()
    assert not s.requests and s.kv.pool.num_free_blocks == 8 and not s.running and not s.waiting


def test_stop_conditions() -> None:
    s = make_scheduler()
    s.add_request(make_request("eos", 3, max_tokens=5))
    s.add_request(make_request("ignore", 3, max_tokens=2, ignore_eos=True))
    s.add_request(make_request("stopid", 3, max_tokens=5, stop_token_ids=(7,), ignore_eos=True))
    reqs = dict(s.requests)
    run_step(s, token=2)  # 2 is the EOS id
    assert reqs["eos"].status == RequestStatus.FINISHED_STOPPED and reqs["eos"].stop_reason is None
    assert reqs["ignore"].status == RequestStatus.RUNNING
    run_step(s, token=7)
    assert reqs["stopid"].status == RequestStatus.FINISHED_STOPPED and reqs["stopid"].stop_reason == 7
    assert reqs["ignore"].status == RequestStatus.FINISHED_LENGTH


def test_prefix_cache_hit_on_admission() -> None:
    s = make_scheduler(num_blocks=16, max_num_batched_tokens=32)
    prompt = list(range(13))
    s.add_request(make_request("a", prompt, max_tokens=2))
    run_step(s)
    s.add_request(make_request("b", prompt, max_tokens=2))
    out = run_step(s)
    assert out.num_scheduled_tokens["b"] == 1  # 12 of 13 tokens were cached
    assert s.requests["b"].num_cached_tokens == 12


def test_prefix_cache_follows_the_salt() -> None:
    s = make_scheduler(num_blocks=16, max_num_batched_tokens=32)
    prompt = list(range(13))
    s.add_request(make_request("a", prompt, max_tokens=2, cache_salt="x"))
    run_step(s)
    a_blocks = s.kv.block_ids("a")[:3]  # its full prompt blocks, cached under salt "x"
    s.add_request(make_request("other", prompt, max_tokens=2, cache_salt="y"))
    s.add_request(make_request("plain", prompt, max_tokens=2))
    out = run_step(s)
    for req_id in ("other", "plain"):  # another salt, or none: the whole prompt is computed, in blocks of its own
        assert out.num_scheduled_tokens[req_id] == 13 and s.requests[req_id].num_cached_tokens == 0
        assert not set(s.kv.block_ids(req_id)) & set(a_blocks)
    s.add_request(make_request("same", prompt, max_tokens=2, cache_salt="x"))
    out = run_step(s)
    assert out.num_scheduled_tokens["same"] == 1 and s.requests["same"].num_cached_tokens == 12
    assert s.kv.block_ids("same")[:3] == a_blocks


def test_invariants_hold_under_random_load() -> None:
    import random

    rng = random.Random(0)
    s = make_scheduler(num_blocks=12, max_num_batched_tokens=8, max_num_seqs=4, max_seq_len=40)
    n = 0
    for _ in range(300):
        if rng.random() < 0.3:
            prompt = [rng.randrange(3, 6) for _ in range(rng.randint(1, 20))]  # tiny alphabet: prefix hits
            s.add_request(make_request(f"r{n}", prompt, max_tokens=rng.randint(1, 12)))
            n += 1
        if rng.random() < 0.05 and s.requests:
            for r in s.finish_requests([rng.choice(list(s.requests))], RequestStatus.FINISHED_ABORTED):
                s.release(r)
        run_step(s, token=rng.randrange(3, 9))
    while s.requests:
        run_step(s)
    assert s.kv.pool.num_free_blocks == 12 and s.num_preemptions > 0
