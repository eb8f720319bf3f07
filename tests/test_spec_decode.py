"""Speculative decoding (service/engine/spec_decode.py): n-gram drafts verified in one multi-token step.

- Greedy output with speculation is token-identical to without (tiny model under preemption and random arrivals;
  the real SmolLM2 on the golden prompts and a long copy-heavy generation), and every KV block comes back.
- The rejection rule keeps the sampled distribution: at draft positions 1..k, conditioned on a fixed prefix, the
  emitted tokens follow the model's (temperature / top-k processed) distribution (chi-square), and a negative
  control that accepts every draft fails the same test.
- Drafts respect max_tokens, stop tokens and cancellation; seeded sampling is reproducible with speculation on.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from service.engine.core import EngineCore
from service.engine.sampler import Sampler
from service.engine.spec_decode import NgramDrafter, SpecConfig, SpecState, VerifyCost, choose_k
from service.request import GenerateRequest, InvalidRequest, Request, RequestStatus, SamplingParams
from tests.engines import build_tiny, run_engine
from tests.engines import tokens_of as _tokens

SPEC = SpecConfig(method="ngram", num_speculative_tokens=6, prompt_lookup_min=2, prompt_lookup_max=4)
GOLDEN = json.loads((Path(__file__).parent / "golden" / "smollm2_golden.json").read_text())


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory, "tiny-spec", max_batch_size=16, max_num_tokens=64, max_seq_len=1024)


def _run(engine: EngineCore, gens: list[GenerateRequest], arrival_steps: list[int] | None = None) -> dict:
    """run_engine's outputs, plus "_counts": (draft tokens, accepted drafts) over the run."""
    counts = [0, 0]

    def count(e: EngineCore) -> None:
        if e.last_step is not None:
            counts[0] += e.last_step.num_spec_draft_tokens
            counts[1] += e.last_step.num_spec_accepted_tokens

    outputs: dict = run_engine(engine, gens, arrival_steps, count)
    outputs["_counts"] = tuple(counts)
    return outputs


def _repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase: the n-gram drafter finds matches from the start."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        phrase = rng.integers(3, 267, size=int(rng.integers(3, 9))).tolist()
        out.append((phrase * int(rng.integers(3, 12)))[: int(rng.integers(10, 90))])
    return out


# ---- drafting ---------------------------------------------------------------------------------------------------
def test_the_drafter_continues_the_longest_most_recent_match() -> None:
    d = NgramDrafter(2, 4)
    tokens = [1, 2, 3, 4, 9, 9, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]
    # [1, 2, 3, 4] (n = 4) occurred at 0..3, followed by 9, 9, 2 ...; shorter matches are not taken
    assert d.propose(tokens, 3) == [9, 9, 2]
    tokens += [9, 8]  # now only [9, 8]... no earlier "9 8": n = 2 fails too
    assert d.propose(tokens, 3) == []
    tokens += [2, 3]  # "2 3" (n = 2) last occurred at 13..14, followed by 4, 9, 8
    assert d.propose(tokens, 5) == [4, 9, 8, 2, 3]
    assert d.propose(tokens, 0) == []
    assert NgramDrafter(2, 4).propose([5, 5], 3) == []  # only a 1-gram recurs: below the minimum ...
    assert NgramDrafter(1, 4).propose([5, 5], 3) == [5]  # ... which 1 allows: "5" at 0, followed by 5


def test_k_follows_acceptance_and_the_measured_verify_cost() -> None:
    cost = VerifyCost(max_rows=9)
    for _ in range(5):  # measured: each extra row costs 30% of a one-row step
        for rows in range(1, 10):
            cost.observe(rows, 10.0 * (1 + 0.3 * (rows - 1)))
    assert choose_k([0.05] * 8, cost) == 0  # prose: drafting would slow it down
    assert choose_k([0.95] * 8, cost) >= 4
    assert choose_k([0.95] * 2, cost) == 2  # capped
    assert choose_k([0.3] + [0.95] * 7, cost) == 0  # a likely miss first: the later positions are rarely reached
    flat = VerifyCost(max_rows=9)
    for _ in range(5):
        for rows in range(1, 10):
            flat.observe(rows, 10.0)  # free rows (bandwidth-bound): more drafts pay while acceptance is high
    assert choose_k([0.9] * 8, flat) == 8


def test_the_drafters_record_by_run_length_decides_how_far_to_draft() -> None:
    state = SpecState(NgramDrafter(2, 4), max_k=8)
    prior = state.acceptance(3)
    assert prior[0] < prior[1] < prior[2]  # before any record: more likely right deeper into a run
    for _ in range(6):  # drafts of 4, every one accepted, and the bonus token where the drafter said
        state.proposed = [7, 7, 7, 7, 5]
        state.record(4, [7, 7, 7, 7, 5])
    copying = state.acceptance(4)
    assert state.run == 30 and copying[0] > 0.9 and copying[0] > prior[2]
    assert state.drafts == 6 and state.draft_tokens == 24 and state.accepted_tokens == 24
    state.proposed = [7, 7, 7]
    state.record(3, [7, 8])  # one accepted, the second rejected: the run starts again
    assert state.run == 0 and state.accepted_per_pos[:3] == [7, 6, 6]
    for _ in range(20):  # plain steps: the drafter's token checked against the model's, and wrong
        state.proposed = [9]
        state.record(0, [4])
    assert state.acceptance(1)[0] < 0.1 and state.drafts == 7  # no draft was paid for to learn it
    before = state.acceptance(1)[0]
    for token in (1, 2, 3):  # the output starts to follow the drafter again, still without drafts
        state.proposed = [token]
        state.record(0, [token])
    assert state.run == 3 and state.acceptance(1)[0] > before
    state.record(0, [4])  # a step the drafter proposed nothing for: no longer in a run, no observation either
    assert state.run == 0
    state.proposed = [5, 6, 9]  # two drafts the scheduler dropped (no KV room): the model's token is checked
    state.record(0, [5])  # against the first of them, the token the drafter proposed for this position
    assert state.run == 1


def test_spec_bench_bounds_the_drafter_by_knowing_each_steps_acceptance() -> None:
    from benchmarks.spec_bench import drafter_bound

    cfg = SpecConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=2)
    phrase = [11, 12, 13, 14, 15, 16, 17, 18]
    # the output copies the prompt's phrase: after its first two tokens every draft is right (4 at a time)
    bound, free = drafter_bound(phrase, phrase[:8], cfg, {k: 1.0 for k in range(1, 5)})
    # positions 1..7: at 1 only [11] is known (no 2-gram), a plain step; at 2 the drafts 13..16 then 17 at 7
    assert free == bound == pytest.approx(7 / 3)
    costly = {k: 1.0 + k for k in range(1, 5)}  # a draft costs as much as a step: drafting never pays
    assert drafter_bound(phrase, phrase[:8], cfg, costly) == (pytest.approx(1.0), pytest.approx(7 / 3))
    assert drafter_bound([1, 2, 3], [7, 8, 9, 10], cfg, costly) == (1.0, 1.0)  # nothing to copy


def test_bad_speculative_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="speculative method"):
        SpecConfig(method="eagle")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpecConfig(method="ngram", prompt_lookup_min=5, prompt_lookup_max=3)
    with pytest.raises(InvalidRequest, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=17)


# ---- exactness ---------------------------------------------------------------------------------------------------
def test_greedy_with_speculation_equals_greedy_without(engine_dir: Path) -> None:
    """16 repetitive prompts, random arrivals, a pool small enough to preempt: every output identical."""
    prompts = _repetitive_prompts(16, seed=3)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    gens = [GenerateRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]
    arrivals = np.random.default_rng(4).integers(0, 30, size=len(gens)).tolist()
    spec = EngineCore(engine_dir, num_kv_blocks=24, speculative=SPEC)
    outs = _run(spec, gens, arrivals)
    drafted, accepted = outs["_counts"]
    assert drafted > 0 and accepted > 0, "the prompts were meant to be drafted from"
    plain = EngineCore(engine_dir, num_kv_blocks=24)
    expected = _run(plain, gens, arrivals)
    for g in gens:
        assert _tokens(outs[g.request_id]) == _tokens(expected[g.request_id]), g.request_id
        assert len(_tokens(outs[g.request_id])) == 40
    assert spec.kv.pool.num_free_blocks == 24 and not spec.scheduler.requests


@pytest.mark.slow
def test_greedy_with_speculation_equals_greedy_without_on_smollm2(smollm2_engine_dir: Path) -> None:
    """The golden prompts, and 1,024 tokens of a copy-heavy prompt (spec_bench's rename-a-variable instruction),
    one request at a time."""
    workloads = json.loads((Path(__file__).parent.parent / "benchmarks" / "data" / "spec_prompts.json").read_text())
    copy = {"role": "user", "content": next(w for w in workloads["workloads"] if w["name"] == "rename")["content"]}
    plain = EngineCore(smollm2_engine_dir, num_kv_blocks=160)
    spec = EngineCore(smollm2_engine_dir, num_kv_blocks=160, speculative=SpecConfig(method="ngram"))
    cases = [(c["prompt_token_ids"], 32) for c in GOLDEN["cases"]]
    cases.append((plain.tokenizer.encode_chat([copy]), 1024))
    total_accepted = 0
    for i, (ids, n) in enumerate(cases):
        gen = GenerateRequest(f"g{i}", ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        out = _run(spec, [gen])
        assert _tokens(out[gen.request_id]) == _tokens(_run(plain, [gen])[gen.request_id]), f"case {i}"
        total_accepted += out["_counts"][1]
    assert total_accepted > 100  # the copy-heavy generation was mostly drafted
    assert spec.kv.pool.num_free_blocks == 160


def _chi2_sf(x: float, df: int) -> float:
    """P(chi-square with df degrees of freedom > x), closed forms for integer df."""
    h = x / 2
    if df % 2 == 0:
        return math.exp(-h) * sum(h**i / math.factorial(i) for i in range(df // 2))
    return math.erfc(math.sqrt(h)) + math.exp(-h) * sum(
        h ** (i - 0.5) / math.gamma(i + 0.5) for i in range(1, (df + 1) // 2)
    )


def _processed(row: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    """The distribution sampling draws from (reference: temperature, then the top_k most likely renormalized)."""
    z = row.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p[np.argsort(-p, kind="stable")[top_k:]] = 0.0
    return p / p.sum()


class _AcceptAll(Sampler):
    """The negative control: a verifier that accepts every draft (wrong: the output follows the drafts)."""

    def verify(self, rows, req, drafts):  # type: ignore[override]
        tokens = list(drafts) + [int(np.argmax(rows[len(drafts)]))]
        return tokens, [None] * len(tokens)


@pytest.mark.parametrize("sampler_kind", ["rejection", "accept_all"])
def test_rejection_sampling_keeps_the_distribution_at_every_draft_position(sampler_kind: str) -> None:
    rng = np.random.default_rng(0)
    vocab, k = 12, 3
    rows = (rng.standard_normal((k + 1, vocab)) * 1.5).astype(np.float32)  # the model at positions 0..k
    drafts = [int(t) for t in rng.integers(0, vocab, size=k)]
    rows[np.arange(k), drafts] += 3.0  # each draft likely (p ~ 0.6-0.8), so 10^4 trials reach position k - 1
    params = SamplingParams(temperature=0.8, top_k=6, max_tokens=64)
    sampler = Sampler(seed=1) if sampler_kind == "rejection" else _AcceptAll(seed=1)
    counts = np.zeros((k + 1, vocab))
    trials = 60_000
    for _ in range(trials):
        req = Request("r", [1, 2, 3], params, arrival_time=0.0)
        out, _ = sampler.verify(rows, req, drafts)
        for i, t in enumerate(out):  # position i is reached with drafts[:i] accepted
            counts[i, t] += 1
    for i in range(k):
        n = counts[i].sum()
        assert n >= 10_000 or sampler_kind == "accept_all", (i, n)
        expected = _processed(rows[i], 0.8, 6) * n
        support = expected > 0
        assert counts[i, ~support].sum() == 0 or sampler_kind == "accept_all"
        chi2 = float((((counts[i] - expected) ** 2)[support] / expected[support]).sum())
        p_value = _chi2_sf(chi2, int(support.sum()) - 1)
        if sampler_kind == "rejection":
            assert p_value > 0.01, (i, chi2, p_value)
        else:
            assert p_value < 1e-6, (i, chi2, p_value)


def test_seeded_sampling_with_speculation_is_reproducible(engine_dir: Path) -> None:
    prompts = _repetitive_prompts(4, seed=9)
    params = SamplingParams(max_tokens=30, temperature=0.7, top_p=0.9, seed=1234, ignore_eos=True)
    gens = [GenerateRequest(f"s{i}", p, params) for i, p in enumerate(prompts)]
    first = _run(EngineCore(engine_dir, num_kv_blocks=64, speculative=SPEC), gens)
    second = _run(EngineCore(engine_dir, num_kv_blocks=64, speculative=SPEC), gens)
    assert first["_counts"][0] > 0
    for g in gens:
        assert _tokens(first[g.request_id]) == _tokens(second[g.request_id])


# ---- stops, cancellation, blocks ------------------------------------------------------------------------------
def test_drafts_never_pass_max_tokens_or_a_stop_token(engine_dir: Path) -> None:
    prompt = [5, 6, 7, 8] * 10
    plain = EngineCore(engine_dir, num_kv_blocks=32)
    ref = _tokens(_run(plain, [GenerateRequest("p", prompt, SamplingParams(max_tokens=50, temperature=0))])["p"])
    stop = ref[len(ref) // 2]
    spec = EngineCore(engine_dir, num_kv_blocks=32, speculative=SPEC)
    for n in (1, 2, 7, 13):
        out = _run(spec, [GenerateRequest("m", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))])
        assert len(_tokens(out["m"])) == n and out["m"][-1].finish_reason == "length"
    gen = GenerateRequest("s", prompt, SamplingParams(max_tokens=50, temperature=0, stop_token_ids=(stop,)))
    out = _run(spec, [gen])["s"]
    assert _tokens(out) == ref[: ref.index(stop) + 1] and out[-1].stop_reason == stop
    assert spec.kv.pool.num_free_blocks == 32


def test_cancelling_speculating_requests_returns_every_block(engine_dir: Path) -> None:
    spec = EngineCore(engine_dir, num_kv_blocks=48, speculative=SPEC)
    gens = [GenerateRequest(f"c{i}", p, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
            for i, p in enumerate(_repetitive_prompts(4, seed=5))]  # fmt: skip
    for g in gens:
        spec.add_request(g)
    drafted = 0
    for step in range(40):
        spec.step()
        spec.scheduler.check_invariants()
        drafted += spec.last_step.num_spec_draft_tokens if spec.last_step else 0
        if step == 12:
            spec.abort([gens[0].request_id, gens[2].request_id])
        if step == 25:
            spec.abort([g.request_id for g in gens])
        if not spec.has_unfinished_requests():
            break
    assert drafted > 0
    assert not spec.scheduler.requests and spec.kv.pool.num_free_blocks == 48
    assert all(r.status != RequestStatus.RUNNING for r in spec.scheduler.running)


def test_a_request_can_turn_speculation_off(engine_dir: Path) -> None:
    spec = EngineCore(engine_dir, num_kv_blocks=32, speculative=SPEC)
    prompt = [5, 6, 7, 8] * 10
    off = GenerateRequest("o", prompt, SamplingParams(max_tokens=20, temperature=0, num_speculative_tokens=0))
    assert _run(spec, [off])["_counts"] == (0, 0)
    on = GenerateRequest("n", prompt, SamplingParams(max_tokens=20, temperature=0, num_speculative_tokens=2))
    assert _run(spec, [on])["_counts"][0] > 0


# ---- through the service -------------------------------------------------------------------------------------
@pytest.mark.server
def test_llm_v1_speculation_field_timing_metrics_and_model_info(engine_dir: Path) -> None:
    import grpc
    from smg_grpc_proto import trtllm_service_pb2 as pb
    from smg_grpc_proto import trtllm_service_pb2_grpc as pb_grpc

    from protos.llm.v1 import llm_pb2
    from tests.servers import generate, running_server

    spec = {"backend.native.speculative": SPEC}
    with running_server(engine_dir, **spec) as server:
        stub = server.stub()
        info = stub.GetModelInfo(llm_pb2.GetModelInfoRequest())
        assert (info.speculative_method, info.num_speculative_tokens) == ("ngram", SPEC.num_speculative_tokens)
        req = llm_pb2.GenerateRequest(
            prompt_token_ids=llm_pb2.TokenIds(ids=[5, 6, 7, 8] * 10),
            sampling=llm_pb2.SamplingParams(temperature=0, num_speculative_tokens=4),
            stopping=llm_pb2.StoppingParams(max_tokens=32, ignore_eos=True),
        )
        chunks, complete = generate(stub, req)
        assert complete.usage.completion_tokens == 32 == sum(len(c.token_ids) for c in chunks)
        t = complete.timing
        assert t.spec_draft_tokens > 0 and 0 <= t.spec_accepted_tokens <= t.spec_draft_tokens
        assert server.metric("llm_spec_decode_num_draft_tokens_total") >= t.spec_draft_tokens
        assert server.metric("llm_spec_decode_num_accepted_tokens_total") == t.spec_accepted_tokens
        if t.spec_accepted_tokens:
            assert server.metric("llm_spec_decode_num_accepted_tokens_per_pos_total", 'position="0"') >= 1
        bad = llm_pb2.GenerateRequest(
            prompt_token_ids=llm_pb2.TokenIds(ids=[5, 6]), sampling=llm_pb2.SamplingParams(num_speculative_tokens=99)
        )
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.num_speculative_tokens" in err.value.details()
        # the TensorRT-LLM worker protocol (gateways) reports the same counts
        worker = pb_grpc.TrtllmServiceStub(server.channel())
        wreq = pb.GenerateRequest(request_id="w1", tokenized=pb.TokenizedInput(input_token_ids=[5, 6, 7, 8] * 10),
                                  max_tokens=32, streaming=False, ignore_eos=True)  # fmt: skip
        wreq.sampling_config.temperature = 0
        done = next(r.complete for r in worker.Generate(wreq) if r.HasField("complete"))
        assert done.spec_draft_tokens > 0 and done.spec_accepted_tokens <= done.spec_draft_tokens


@pytest.mark.server
def test_triton_door_reports_the_drafts_and_refuses_external_ones(engine_dir: Path) -> None:
    import tritonclient.grpc as tg
    from tritonclient.utils import InferenceServerException

    from tests.servers import running_server
    from tests.triton_clients import inputs

    prompt = [5, 6, 7, 8] * 10
    with running_server(
        engine_dir, triton_port=0, triton_decoupled=False, **{"backend.native.speculative": SPEC}
    ) as server:
        client = tg.InferenceServerClient(f"127.0.0.1:{server.server.triton_port}")
        try:
            base = dict(input_ids=prompt, input_lengths=len(prompt), request_output_len=32, end_id=-1,
                        runtime_top_k=1, return_perf_metrics=True)  # fmt: skip
            res = client.infer("tensorrt_llm", inputs("tensorrt_llm", **base))
            drafted = int(res.as_numpy("total_draft_tokens")[0][0])
            accepted = int(res.as_numpy("total_accepted_draft_tokens")[0][0])
            assert drafted > 0 and 0 <= accepted <= drafted
            assert res.as_numpy("acceptance_rate")[0][0] == pytest.approx(accepted / drafted)
            with pytest.raises(InferenceServerException, match="draft_input_ids"):
                client.infer("tensorrt_llm", inputs("tensorrt_llm", **base, draft_input_ids=[5, 6]))
        finally:
            client.close()


def test_speculation_on_another_backend_is_refused_at_startup(engine_dir: Path) -> None:
    from service.backends import preflight
    from service.config import BackendConfig, NativeConfig
    from service.errors import BackendLoadError

    cfg = BackendConfig(engine_dir=str(engine_dir), backend="triton", native=NativeConfig(speculative=SPEC))
    with pytest.raises(BackendLoadError, match="native backend only"):
        preflight(cfg)


def test_the_load_tester_reports_acceptance() -> None:
    from clients.loadtest.metrics import SLO, RequestRecord, summarize

    recs = [RequestRecord(input_tokens=4, chunk_times=[1.0, 1.1], chunk_tokens=[1, 3], ok=True,
                          spec_draft_tokens=d, spec_accepted_tokens=a) for d, a in ((10, 6), (6, 0))]  # fmt: skip
    summary = summarize(recs, 1.0, SLO())
    assert summary["spec_draft_tokens"] == 16 and summary["spec_acceptance"] == pytest.approx(6 / 16)
    assert summarize([RequestRecord(input_tokens=4, ok=True)], 1.0, SLO())["spec_acceptance"] is None


@pytest.mark.slow
def test_constrained_requests_speculate_within_their_grammar(smollm2_engine_dir: Path) -> None:
    """A JSON-schema request on a copy-heavy prompt: drafts only where the grammar allows them, the matcher
    rolled back past rejected ones, the output identical to plain constrained greedy (and valid JSON)."""
    from service.request import Constraint

    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}},
              "required": ["items"]}  # fmt: skip
    text = "Copy this JSON exactly: " + json.dumps({"items": [f"item number {i}" for i in range(12)]})
    plain = EngineCore(smollm2_engine_dir, num_kv_blocks=64)
    spec = EngineCore(smollm2_engine_dir, num_kv_blocks=64, speculative=SPEC)
    ids = plain.tokenizer.encode_chat([{"role": "user", "content": text}])
    params = SamplingParams(max_tokens=160, temperature=0, constraint=Constraint("json_schema", json.dumps(schema)))
    gen = GenerateRequest("j", ids, params)
    expected = _tokens(_run(plain, [gen])["j"])
    out = _run(spec, [gen])
    assert out["_counts"][1] > 0, "the copy was meant to be drafted"
    assert _tokens(out["j"]) == expected
    assert out["j"][-1].finish_reason == "stop"
    json.loads("".join(o.new_text for o in out["j"]))  # the grammar held
    assert spec.kv.pool.num_free_blocks == 64
