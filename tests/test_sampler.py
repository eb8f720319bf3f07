"""Sampler: greedy, temperature / top-k / top-p / min-p against brute force, seeds, penalties, logprobs."""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.sampler import Sampler, sample_row, token_logprob
from service.errors import InvalidRequest
from service.request import Request, SamplingParams

V = 50


def _req(rid: str = "r", prompt: list[int] | None = None, output: list[int] | None = None, **params) -> Request:
    req = Request(rid, prompt or [1, 2, 3], SamplingParams(**params), arrival_time=0.0, eos_token_ids=frozenset({0}))
    for t in output or []:
        req.append_token(t, 0.0)
    return req


def _reference(row: np.ndarray, p: SamplingParams, u: float) -> int:
    """Brute force: full softmax, min_p, full sort, top_k, top_p, inverse CDF."""
    z = row.astype(np.float64) / p.temperature
    probs = np.exp(z - z.max())
    probs[probs < p.min_p] = 0
    order = np.lexsort((np.arange(len(probs)), -probs))
    order = order[probs[order] > 0]
    if p.top_k:
        order = order[: p.top_k]
    if p.top_p < 1:
        c = np.cumsum(probs[order])
        order = order[: int(np.searchsorted(c, p.top_p * c[-1])) + 1]
    if not p.top_k and p.top_p >= 1:
        order = np.arange(len(probs))
    c = np.cumsum(probs[order])
    return int(order[min(int(np.searchsorted(c, u * c[-1], side="right")), len(order) - 1)])


@pytest.mark.parametrize("seed", range(40))
def test_filters_match_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    scale = rng.choice([0.5, 3.0, 12.0])  # flat to peaked distributions
    row = (rng.standard_normal(V) * scale).astype(np.float32)
    params = SamplingParams(
        temperature=float(rng.choice([0.3, 1.0, 1.7])),
        top_k=int(rng.choice([0, 1, 5, 20])),
        top_p=float(rng.choice([1.0, 0.9, 0.5, 0.05])),
        min_p=float(rng.choice([0.0, 0.0, 0.05, 0.3])),
    )
    for u in rng.random(25):
        assert sample_row(row, _req(**_fields(params)), float(u)) == _reference(row, params, float(u))


def _fields(p: SamplingParams) -> dict:
    return {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p}


def test_flat_distribution_falls_back_to_a_full_sort() -> None:
    # 5000 equally likely tokens: top_p=0.9 needs 4500 of them, far below the candidate threshold
    row = np.zeros(5000, dtype=np.float32)
    p = SamplingParams(temperature=1.0, top_p=0.9)
    for u in (0.0, 0.5, 0.999):
        assert sample_row(row, _req(top_p=0.9), u) == _reference(row, p, u)


def test_temperature_sampling_follows_the_softmax() -> None:
    row = np.log(np.array([0.5, 0.3, 0.2, 0.0], dtype=np.float64) + 1e-30).astype(np.float32)
    sampler = Sampler(seed=0)
    counts = np.zeros(4)
    for _ in range(4000):
        counts[sampler.sample(row[None, :], [_req(temperature=1.0)]).token_ids[0]] += 1
    assert np.allclose(counts / counts.sum(), [0.5, 0.3, 0.2, 0.0], atol=0.03)


def test_greedy_and_degenerate_filters_pick_the_argmax() -> None:
    row = np.random.default_rng(1).standard_normal((3, V)).astype(np.float32)
    s = Sampler(seed=0)
    reqs = [_req(temperature=0), _req(temperature=1.0, top_k=1), _req(temperature=1.0, top_p=1e-6)]
    assert s.sample(row, reqs).token_ids == [int(np.argmax(r)) for r in row]


def test_seeded_request_ignores_batch_composition() -> None:
    rng = np.random.default_rng(2)
    rows = rng.standard_normal((6, V)).astype(np.float32)
    target = rows[3].copy()
    alone = Sampler().sample(target[None, :], [_req("x", temperature=1.0, seed=42)]).token_ids[0]
    others = [_req(f"o{i}", temperature=1.0) for i in range(5)]
    batch = others[:3] + [_req("x", temperature=1.0, seed=42)] + others[3:]
    assert Sampler().sample(rows, batch).token_ids[3] == alone
    # a different position in the output draws a different number (not the same token forever)
    draws = {
        Sampler().sample(np.zeros((1, V), np.float32), [_req(temperature=1.0, seed=42, output=[5] * k)]).token_ids[0]
        for k in range(12)
    }
    assert len(draws) > 3


def test_repetition_presence_frequency_penalties() -> None:
    row = np.array([2.0, -2.0, 1.0, 0.5], dtype=np.float32)
    req = _req(prompt=[0], output=[1, 2, 2], repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    edited = row.copy()
    Sampler._edit(edited, req)
    # repetition: positive / 2, negative * 2 for tokens 0, 1, 2; then presence + frequency on output tokens 1, 2
    assert edited.tolist() == pytest.approx([1.0, -4.0 - 0.5 - 0.25, 0.5 - 0.5 - 0.5, 0.5])


def test_min_tokens_suppresses_eos_and_stop_ids() -> None:
    row = np.array([10.0, 1.0, 9.0, 0.0], dtype=np.float32)  # EOS (0) and stop id 2 lead
    s = Sampler()
    assert s.sample(row[None, :], [_req(temperature=0, min_tokens=2, stop_token_ids=(2,))]).token_ids == [1]
    done = _req(temperature=0, min_tokens=2, stop_token_ids=(2,), output=[1, 1])
    assert s.sample(row[None, :], [done]).token_ids == [0]


def test_logprobs_of_chosen_and_top_tokens() -> None:
    row = np.random.default_rng(3).standard_normal(V).astype(np.float32)
    lp = token_logprob(row, 7, 5)
    ref = row.astype(np.float64) - np.log(np.exp(row.astype(np.float64)).sum())
    assert lp.logprob == pytest.approx(ref[7])
    assert [t for t, _ in lp.top] == list(np.argsort(-ref)[:5])
    assert [v for _, v in lp.top] == pytest.approx(sorted(ref, reverse=True)[:5])
    out = Sampler().sample(row[None, :], [_req(temperature=0, logprobs=3)])
    assert out.logprobs[0].token_id == out.token_ids[0] and len(out.logprobs[0].top) == 3


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.1, "temperature"),
        ("temperature", float("nan"), "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("top_k", -1, "top_k"),
        ("max_tokens", 0, "max_tokens"),
        ("logprobs", 21, "logprobs"),
        ("min_p", 2.0, "min_p"),
        ("repetition_penalty", 0.0, "repetition_penalty"),
        ("presence_penalty", 3.0, "presence_penalty"),
        ("stop", tuple(str(i) for i in range(17)), "stop"),
        ("stop_token_ids", tuple(range(10**6)), "stop_token_ids"),
        ("seed", -1, "seed"),
    ],
)
def test_invalid_params_name_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams(**{field: value})


def test_top_p_counts_the_mass_of_tokens_outside_the_candidates() -> None:
    # token 0 (p=1), token 1 (p=0.2) and 4000 tokens of 5e-5 each (below the candidate threshold, 0.2 in all):
    # with top_p=0.8 the nucleus must reach 0.8 * 1.4 = 1.12, so it is {0, 1}, not {0}
    probs = np.concatenate([[1.0, 0.2], np.full(4000, 5e-5)])
    row = np.log(probs).astype(np.float32)
    p = SamplingParams(temperature=1.0, top_p=0.8)
    picked = {sample_row(row, _req(top_p=0.8), u) for u in np.linspace(0, 0.999, 50)}
    assert picked == {0, 1}
    assert all(sample_row(row, _req(top_p=0.8), u) == _reference(row, p, u) for u in np.linspace(0, 0.999, 50))
