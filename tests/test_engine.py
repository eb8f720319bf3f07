"""EngineCore end to end on the tiny model: batch invariance under preemption, seeds, stops, prefix reuse, timers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.engine.core import EngineCore
from service.request import GenerateRequest, SamplingParams
from tests.engines import build_tiny
from tests.engines import run_engine as _run
from tests.engines import tokens_of as _tokens

VOCAB = 267


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory, "tiny-batch", max_batch_size=32, max_num_tokens=64, max_seq_len=1024)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=int(rng.integers(4, 120))).tolist() for _ in range(n)]


def test_batch_invariance_with_chunked_prefill_and_preemption(engine_dir: Path) -> None:
    """32 prompts together (random arrivals, 64-token steps, a pool that forces preemption) == each alone."""
    prompts = _prompts(32, seed=0)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    gens = [GenerateRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]
    arrivals = np.random.default_rng(1).integers(0, 40, size=len(gens)).tolist()
    together = EngineCore(engine_dir, num_kv_blocks=40)  # 40 blocks x 16 tokens: far less than 32 requests need
    outs = _run(together, gens, arrivals)
    assert together.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    alone = EngineCore(engine_dir, num_kv_blocks=40, enable_prefix_caching=False)
    for g in gens:
        expected = _tokens(_run(alone, [g])[g.request_id])
        assert _tokens(outs[g.request_id]) == expected, g.request_id
    assert together.kv.pool.num_free_blocks == 40 and not together.scheduler.requests


def test_seeded_sampling_is_batch_and_preemption_invariant(engine_dir: Path) -> None:
    prompts = _prompts(12, seed=2)
    gens = [
        GenerateRequest(f"s{i}", p, SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=i, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    together = EngineCore(engine_dir, num_kv_blocks=24)
    outs = _run(together, gens, list(range(0, 24, 2)))
    assert together.scheduler.num_preemptions > 0
    alone = EngineCore(engine_dir, num_kv_blocks=24)
    for g in gens:
        assert _tokens(outs[g.request_id]) == _tokens(_run(alone, [g])[g.request_id])


def test_stop_string_across_token_boundaries(engine_dir: Path) -> None:
    engine = EngineCore(engine_dir, num_kv_blocks=64)
    prompt = engine.tokenizer.encode("Hello there, general")
    free = _run(
        engine, [GenerateRequest("free", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))]
    )
    text = "".join(o.new_text for o in free["free"])
    stop = text[10:14]  # four characters: several byte-level tokens
    assert len(engine.tokenizer.encode(stop, add_special_tokens=False)) > 1
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(stop, "never-there"))
    outs = _run(engine, [GenerateRequest("stopped", prompt, params)])["stopped"]
    got = "".join(o.new_text for o in outs)
    assert got == text[: text.index(stop)]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    assert len(_tokens(outs)) < 40


def test_finish_reasons_and_usage(engine_dir: Path) -> None:
    engine = EngineCore(engine_dir, num_kv_blocks=64)
    prompt = [5, 6, 7, 8]
    length = _run(
        engine, [GenerateRequest("len", prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))]
    )
    last = length["len"][-1]
    assert last.finish_reason == "length" and last.num_output_tokens == 5 and last.num_prompt_tokens == 4
    first_token = _tokens(length["len"])[0]
    params = SamplingParams(max_tokens=5, temperature=0, stop_token_ids=(first_token,))
    stopped = _run(engine, [GenerateRequest("stopid", prompt, params)])["stopid"]
    assert stopped[-1].finish_reason == "stop" and stopped[-1].stop_reason == first_token
    assert _tokens(stopped) == [first_token]


def test_prefix_reuse_prefills_only_the_rest(engine_dir: Path) -> None:
    """Two requests sharing a 512-token prefix: the second reports 512 cached tokens, computes only its suffix."""
    rng = np.random.default_rng(5)
    prefix = rng.integers(3, VOCAB, size=512).tolist()
    first = GenerateRequest("first", prefix + [10, 11, 12], SamplingParams(max_tokens=4, temperature=0))
    second = GenerateRequest("second", prefix + [20, 21, 22, 23, 24], SamplingParams(max_tokens=4, temperature=0))
    engine = EngineCore(engine_dir, num_kv_blocks=128)
    _run(engine, [first])
    engine.add_request(second)
    prefill_tokens = 0
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        prefill_tokens += engine.last_step.num_prefill_tokens
    assert outs[-1].num_cached_tokens == 512
    assert prefill_tokens == 5  # only the 5 tokens after the shared prefix
    cold = EngineCore(engine_dir, num_kv_blocks=128, enable_prefix_caching=False)
    assert _tokens(outs) == _tokens(_run(cold, [second])["second"])  # reused KV gives the same tokens


def test_timing_is_consistent(engine_dir: Path) -> None:
    engine = EngineCore(engine_dir, num_kv_blocks=64)
    gens = [
        GenerateRequest(f"t{i}", p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        for i, p in enumerate(_prompts(4, 9))
    ]
    for outs in _run(engine, gens).values():
        t = outs[-1].timing
        assert t.queue_ms >= 0 and t.prefill_ms > 0 and t.decode_ms > 0
        assert t.ttft_ms == pytest.approx(t.queue_ms + t.prefill_ms)
        assert t.tpot_ms == pytest.approx(t.decode_ms / 5)
        assert len(t.itl_ms) == 5 and sum(t.itl_ms) == pytest.approx(t.decode_ms)
        assert t.e2e_ms >= t.ttft_ms + t.decode_ms - 1e-6


def test_step_stats_count_work(engine_dir: Path) -> None:
    engine = EngineCore(engine_dir, num_kv_blocks=64)
    engine.add_request(GenerateRequest("a", list(range(3, 40)), SamplingParams(max_tokens=2, temperature=0)))
    engine.step()
    s = engine.last_step
    assert s.num_prefill_tokens == 37 and s.num_decode_tokens == 0 and s.num_sampled == 1
    assert s.flops > 0 and s.bytes_moved > 0 and s.forward_ms > 0
    engine.step()
    assert engine.last_step.num_decode_tokens == 1 and engine.last_step.num_prefill_tokens == 0


def test_invalid_requests_are_rejected_before_queueing(engine_dir: Path) -> None:
    from service.errors import InvalidRequest

    engine = EngineCore(engine_dir, num_kv_blocks=64)
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        engine.add_request(GenerateRequest("v", [1, VOCAB + 5], SamplingParams()))
    with pytest.raises(InvalidRequest, match="max_seq_len"):
        engine.add_request(GenerateRequest("l", [5] * 1000, SamplingParams(max_tokens=100)))
    assert not engine.scheduler.requests


@pytest.mark.slow
def test_batch_invariance_on_smollm2(smollm2_engine_dir: Path) -> None:
    """The same property on the real model: float32 batched GEMMs must not flip a greedy token."""
    import json

    golden = json.loads((Path(__file__).parent / "golden" / "smollm2_golden.json").read_text())
    engine = EngineCore(smollm2_engine_dir, num_kv_blocks=60, max_num_batched_tokens=64, max_num_seqs=32)
    texts = [c.get("text") or c["messages"][-1]["content"] for c in golden["cases"]]
    texts += [c["text"] for c in golden["tokenizer_cases"] if c["text"].strip()]
    texts += [f"Write a short story about a {animal}." for animal in ("fox", "whale", "heron", "beetle", "lynx")]
    prompts = [engine.tokenizer.encode(t)[:200] for t in texts][:32]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    gens = [GenerateRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]
    assert len(gens) == 32
    outs = _run(engine, gens, np.random.default_rng(1).integers(0, 40, size=len(gens)).tolist())
    assert engine.scheduler.num_preemptions > 0
    alone = EngineCore(smollm2_engine_dir, num_kv_blocks=60, enable_prefix_caching=False)
    for g in gens:
        assert _tokens(outs[g.request_id]) == _tokens(_run(alone, [g])[g.request_id]), g.request_id
