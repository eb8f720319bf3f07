"""Fairness of the scheduler, counted in steps (deterministic; the reliability bench reports milliseconds).

- A prompt of 0.8 x max_seq_len under a steady stream of short requests starts within a bounded number of steps.
- A short request arriving during a long chunked prefill gets its first token within one prefill chunk plus one
  decode step: the long prefill leaves part of each step's token budget to waiting requests.
"""

from __future__ import annotations

from tests.factories import make_request, make_scheduler, run_step


def test_long_prompt_starts_within_bounded_steps_under_a_stream_of_short_ones() -> None:
    max_seq_len, block_size = 256, 4
    s = make_scheduler(num_blocks=80, block_size=block_size, max_num_seqs=8, max_num_batched_tokens=64,
                       max_seq_len=max_seq_len, max_bypass=8)  # fmt: skip
    for i in range(6):  # short requests already decoding hold most of the pool between them
        s.add_request(make_request(f"warm{i}", 8, max_tokens=30))
    run_step(s)
    long = make_request("long", int(0.8 * max_seq_len), max_tokens=8)  # 205 tokens + 8: 54 of the 80 blocks
    s.add_request(long)
    started, arrivals = None, 0
    for step in range(200):
        s.add_request(make_request(f"short{arrivals}", 6, max_tokens=20))  # one new short request every step
        arrivals += 1
        run_step(s)
        if long.first_scheduled_time is not None:
            started = step
            break
    assert started is not None, "the long prompt never started"
    assert long.num_bypassed <= 8
    assert started <= 60, f"the long prompt waited {started} steps"


def test_short_request_during_a_long_chunked_prefill_waits_at_most_one_chunk() -> None:
    budget = 64
    s = make_scheduler(num_blocks=200, block_size=4, max_num_seqs=8, max_num_batched_tokens=budget, max_seq_len=512)
    s.add_request(make_request("long", 400, max_tokens=4))  # 7 chunks of prefill at least
    run_step(s)  # first chunk
    assert s.requests["long"].num_computed_tokens > 0
    short = make_request("short", 10, max_tokens=4)
    s.add_request(short)
    steps = 0
    while not short.output_token_ids:
        run_step(s)
        steps += 1
        assert steps <= 1, "the short request waited for the whole long prefill"
    long = s.requests["long"]
    assert 0 < long.num_computed_tokens < 400  # the long prompt was still prefilling meanwhile


def test_a_lone_long_prefill_uses_the_whole_budget() -> None:
    budget = 64
    s = make_scheduler(num_blocks=200, block_size=4, max_num_seqs=8, max_num_batched_tokens=budget, max_seq_len=512)
    s.add_request(make_request("long", 400, max_tokens=4))
    chunks = [run_step(s).num_scheduled_tokens["long"] for _ in range(6)]
    assert chunks == [budget] * 6  # nothing waits: no budget is held back
