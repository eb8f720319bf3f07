"""Fairness of the scheduler, counted in steps (deterministic; the reliability bench reports milliseconds).

- A prompt of 0.8 x max_seq_len under a steady stream of short requests starts within a bounded number of steps.
- A short request arriving during a long chunked prefill gets its first token within one prefill chunk plus one
  decode step: the long prefill leaves part of each step's token budget to waiting requests.
- Every running decode gets a token in every step while a long prompt is prefilled, whichever was admitted
  first, and the prefill's chunk is capped while decodes run (shorter deep into the prompt, where each token
  attends to more keys), so the step carrying the decodes stays short.
"""

from __future__ import annotations

import pytest

from service.engine.core import EngineCore
from service.request import GenerateRequest, SamplingParams
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


def test_every_decode_gets_a_token_in_every_step_of_a_long_prefill() -> None:
    s = make_scheduler(num_blocks=400, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_seq_len=1024,
                       long_prefill_token_threshold=16)  # fmt: skip
    s.add_request(make_request("long", 600, max_tokens=2))  # admitted first: it sits ahead of the decodes
    run_step(s)
    decodes = [make_request(f"d{i}", 3, max_tokens=200) for i in range(3)]
    for d in decodes:
        s.add_request(d)
    run_step(s)  # the decodes' prompts
    long = s.requests["long"]
    left = long.num_prompt_tokens - long.num_computed_tokens
    steps = 0
    while long.num_computed_tokens < long.num_prompt_tokens:
        before = [len(d.output_token_ids) for d in decodes]
        out = run_step(s)
        assert [len(d.output_token_ids) for d in decodes] == [b + 1 for b in before], "a decode waited"
        assert out.num_scheduled_tokens.get("long", 0) <= 16  # the capped chunk
        steps += 1
    assert left > 400 and steps == -(-left // 16)  # the prefill went on meanwhile, 16 tokens a step


def test_a_lone_prefill_is_not_capped_and_the_cap_shrinks_with_the_keys() -> None:
    s = make_scheduler(num_blocks=400, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_seq_len=1024,
                       long_prefill_token_threshold=32, attention_cost_per_key=0.01)  # fmt: skip
    s.add_request(make_request("long", 600, max_tokens=2))
    assert run_step(s).num_scheduled_tokens["long"] == 64  # no decode runs: the whole budget
    assert s.cfg.prefill_cap(0) == 32 and s.cfg.prefill_cap(100) == 16 and s.cfg.prefill_cap(10_000) == 1
    s.add_request(make_request("d", 3, max_tokens=50))
    run_step(s)  # d's prompt
    computed = s.requests["long"].num_computed_tokens
    out = run_step(s)
    assert out.num_scheduled_tokens["long"] == s.cfg.prefill_cap(computed) < 32


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory):
    from tests.engines import build_tiny

    return build_tiny(tmp_path_factory, "tiny-fair", max_batch_size=8, max_num_tokens=64, max_seq_len=1024)


def test_engine_records_a_token_for_every_decode_in_every_step_of_a_long_prefill(engine_dir) -> None:
    """The same, from the engine's own step records (outputs and StepStats) over the real runner."""
    core = EngineCore(engine_dir, num_kv_blocks=256, long_prefill_token_threshold=16)
    greedy = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    core.add_request(GenerateRequest("long", list(range(3, 250)) * 3, SamplingParams(max_tokens=1, temperature=0)))
    core.step()
    for i in range(3):
        core.add_request(GenerateRequest(f"d{i}", [5, 6, 7 + i], greedy))
    core.step()  # the decodes' prompts (and a chunk of the long one)
    prefill_steps = 0
    while "long" in core.scheduler.requests:
        got = {o.request_id: len(o.new_token_ids) for o in core.step()}
        assert all(got.get(f"d{i}") == 1 for i in range(3)), f"a decode got no token: {got}"
        assert core.last_step.num_decode_tokens == 3 and core.last_step.num_prefill_tokens <= 16
        prefill_steps += 1
    assert prefill_steps > 30  # 741 prompt tokens, at most 16 a step
    core.abort(list(core.scheduler.requests))
    core.scheduler.check_invariants()
