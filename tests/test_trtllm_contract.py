"""The TensorRT-LLM builder and backend against the TensorRT-LLM test double (tests/trtllm_double).

The double is generated from the real 1.2 surface (tests/data/trtllm_surface_1.2.json) and runs our native
engine underneath, so these tests check the exact calls, keywords and values our code sends to TensorRT-LLM,
and the behaviour of the backend on real streams. What they cannot show is TensorRT-LLM itself running: the
gpu-marked tests in test_trtllm_gpu.py do that where a GPU and TensorRT-LLM exist (docs/gpu.md).
"""

from __future__ import annotations

import asyncio
import datetime
import gc
import inspect
import json
import os
import subprocess
import weakref
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from build_engine.builder import build
from build_engine.spec import EngineFormatError, TrtllmBuildConfig, load_trtllm_build_config
from build_engine.trtllm_builder import TOKENS_PER_BLOCK, TrtllmOptions
from protos.llm.v1 import llm_pb2
from service.backends import trtllm_rules
from service.backends.remote import EndIds, RemoteRequest
from service.backends.trtllm import TrtllmBackend, cache_salt_id, sampling_config
from service.backends.trtllm_rules import (
    FINISH_REASONS,
    PromptLimits,
    UnknownFinishReason,
    finish_reasons,
    finish_stop,
)
from service.config import AdmissionConfig, BackendConfig, TrtllmConfig
from service.errors import BackendLoadError
from service.request import Constraint, GenerateRequest, SamplingParams
from service.stops import Stop
from tests.servers import generate, ids_and_text, running_server
from tests.trtllm_double import installed
from tests.trtllm_double.executor import ExecutorDouble
from tests.trtllm_double.surface import ALLOW_LIST, PARTIAL, SURFACE, known_names, signature
from tests.waiting import wait_until, wait_until_async

pytestmark = pytest.mark.server

LIMITS = {"max_seq_len": 512, "max_num_tokens": 64, "max_batch_size": 8, "kv_block_size": 16}
EXECUTOR = "tensorrt_llm.bindings.executor"


@pytest.fixture(scope="module")
def double():
    with installed() as d:
        yield d


@pytest.fixture(scope="module")
def engine(double, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trtllm") / "tiny-fp16"
    build("tiny-random", out, LIMITS, progress=False, backend="trtllm", trtllm=TrtllmOptions(dtype="float16"))
    return out


def _last(double, short: str):
    objs = double.recorder.built(short)
    assert objs, f"no {short} was built"
    return objs[-1]


# ---- build --------------------------------------------------------------------------------------------------------


def test_fp16_build_calls_and_files(double, tmp_path: Path) -> None:
    double.recorder.clear()
    out = tmp_path / "e"
    build("tiny-random", out, LIMITS, progress=False, backend="trtllm", trtllm=TrtllmOptions(dtype="float16"))
    rec = double.recorder
    assert rec.called("tensorrt_llm.models.LLaMAForCausalLM.from_hugging_face") == [
        ("dtype", "hf_model_or_dir", "mapping")
    ]  # no quant_config for a plain fp16 build
    mapping = _last(double, "Mapping")
    assert (mapping.world_size, mapping.rank, mapping.tp_size, mapping.pp_size) == (1, 0, 1, 1)
    bc = _last(double, "BuildConfig")
    assert (bc.max_batch_size, bc.max_input_len, bc.max_seq_len, bc.max_num_tokens, bc.max_beam_width) == (
        8,
        512,
        512,
        64,
        1,
    )
    assert bc.kv_cache_type == double.modules["tensorrt_llm.llmapi.kv_cache_type"].KVCacheType.PAGED
    pc = bc.plugin_config
    assert (pc.gpt_attention_plugin, pc.gemm_plugin, pc.tokens_per_block) == ("float16", "float16", 16)
    assert pc.remove_input_padding and pc.context_fmha and pc.use_paged_context_fmha
    assert rec.called("tensorrt_llm.build") and rec.called("tensorrt_llm.builder.Engine.save") == [("engine_dir",)]
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "rank0.engine", "manifest.json", "tokenizer.json", "tokenizer_config.json"} <= files
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["backend"] == "trtllm" and manifest["settings"]["dtype"] == "float16"
    assert manifest["built"]["tensorrt_llm_version"] == "1.2.1"
    assert set(manifest["files"]) >= {"config.json", "rank0.engine", "tokenizer.json"}
    again = build("tiny-random", out, LIMITS, progress=False, backend="trtllm", trtllm=TrtllmOptions(dtype="float16"))
    assert again.skipped  # the same engine is not rebuilt


def test_int8_weight_only_build(double, tmp_path: Path) -> None:
    double.recorder.clear()
    options = TrtllmOptions(dtype="bfloat16", weight_only="int8")
    build("tiny-random", tmp_path / "e", LIMITS, progress=False, backend="trtllm", trtllm=options)
    quant = _last(double, "QuantConfig")
    assert quant.quant_algo == double.modules["tensorrt_llm.quantization"].QuantAlgo.W8A16
    assert double.recorder.called("tensorrt_llm.models.LLaMAForCausalLM.from_hugging_face") == [
        ("dtype", "hf_model_or_dir", "mapping", "quant_config")
    ]
    assert _last(double, "PluginConfig").gemm_plugin == "bfloat16"


def test_tp2_builds_one_engine_per_rank(double, tmp_path: Path) -> None:
    double.recorder.clear()
    out = tmp_path / "tp2"
    build("tiny-random", out, LIMITS, progress=False, backend="trtllm", trtllm=TrtllmOptions(tp_size=2))
    mappings = double.recorder.built("Mapping")
    assert [(m.world_size, m.rank, m.tp_size, m.pp_size) for m in mappings] == [(2, 0, 2, 1), (2, 1, 2, 1)]
    assert len(double.recorder.called("tensorrt_llm.builder.Engine.save")) == 2
    assert {"rank0.engine", "rank1.engine"} <= {p.name for p in out.iterdir()}
    config = json.loads((out / "config.json").read_text())
    assert config["pretrained_config"]["mapping"]["world_size"] == 2


def test_tokens_per_block_defaults_to_tensorrt_llms_32(double, tmp_path: Path) -> None:
    """Without --kv-block-size a TensorRT-LLM build takes TensorRT-LLM's tokens_per_block (32); the native engine
    keeps its own 16 (BuildLimits)."""
    double.recorder.clear()
    limits = {k: v for k, v in LIMITS.items() if k != "kv_block_size"}
    result = build("tiny-random", tmp_path / "e", limits, progress=False, backend="trtllm", trtllm=TrtllmOptions())
    assert _last(double, "PluginConfig").tokens_per_block == TOKENS_PER_BLOCK == 32
    assert result.config.limits.kv_block_size == 32
    cli = json.loads((tmp_path / "e" / "config.json").read_text())["build_config"]["plugin_config"]
    assert cli["tokens_per_block"] == 32
    from build_engine.__main__ import parse_args
    from build_engine.spec import BuildLimits

    assert parse_args(["--model", "m", "--output", "o"]).kv_block_size is None  # the backend decides
    assert BuildLimits().kv_block_size == 16


# ---- executor configuration and request mapping ------------------------------------------------------------


def _backend(engine: Path, **trtllm) -> TrtllmBackend:
    return TrtllmBackend(BackendConfig(engine_dir=str(engine), trtllm=TrtllmConfig(**trtllm)))


def test_executor_configuration(double, engine: Path) -> None:
    ex = double.executor
    backend = _backend(engine)
    try:
        executor = backend.executor
        assert executor.model_path == str(engine) and executor.model_type == ex.ModelType.DECODER_ONLY
        cfg = executor.executor_config
        assert cfg.max_beam_width == 1 and cfg.enable_chunked_context is True
        assert cfg.scheduler_config.capacity_scheduler_policy == ex.CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
        assert cfg.kv_cache_config.enable_block_reuse is True
        assert cfg.kv_cache_config.free_gpu_memory_fraction == 0.9
        assert cfg.parallel_config is None  # one GPU: leader mode, no orchestrator
    finally:
        backend.executor.shutdown()
    other = _backend(engine, scheduler_policy="max_utilization", enable_chunked_context=False)
    try:
        cfg = other.executor.executor_config
        assert cfg.scheduler_config.capacity_scheduler_policy == ex.CapacitySchedulerPolicy.MAX_UTILIZATION
        assert cfg.enable_chunked_context is False
    finally:
        other.executor.shutdown()


def test_request_mapping(double, engine: Path) -> None:
    ex = double.executor
    backend = _backend(engine)
    try:
        greedy = backend._request(GenerateRequest("a", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0)))
        assert greedy.input_token_ids == [5, 6, 7] and greedy.max_tokens == 4 and greedy.streaming
        assert (
            greedy.sampling_config.top_k == 1
            and greedy.end_id == backend.end_ids.end_id
            and greedy.pad_id == backend.end_ids.pad_id
        )
        assert greedy.output_config.exclude_input_from_output and greedy.output_config.return_perf_metrics
        assert greedy.stop_words is None
        stops = SamplingParams(max_tokens=4, stop_token_ids=(9, 11))
        assert backend._request(GenerateRequest("b", [5], stops)).stop_words == [[9], [11]]
        ignore = backend._request(GenerateRequest("c", [5], SamplingParams(ignore_eos=True)))
        assert ignore.end_id == -1
        assert greedy.cache_salt_id is None  # no salt: blocks reused across every unsalted request
        salted = backend._request(GenerateRequest("d", [5], cache_salt="tenant-a"))
        assert salted.cache_salt_id == cache_salt_id("tenant-a") == 0xE17EC77DAF07A780  # stable across processes
        assert backend._request(GenerateRequest("e", [5], cache_salt="tenant-b")).cache_salt_id != salted.cache_salt_id
        with pytest.raises(TypeError, match="cache_salt_id"):
            double.executor.Request([5], 4, cache_salt_id=-1)  # a uint64, as nanobind converts it
    finally:
        backend.executor.shutdown()
    sampled = sampling_config(ex, SamplingParams(temperature=0.7))
    assert (sampled.temperature, sampled.top_p, sampled.top_k) == (0.7, 1.0, None)  # top_p=1.0 or it is greedy
    seeds = {sampling_config(ex, SamplingParams(temperature=0.7)).seed for _ in range(8)}
    assert len(seeds) == 8  # a seed of its own per request (TensorRT-LLM's default is 0 for all)
    assert sampling_config(ex, SamplingParams(temperature=0.7, seed=42)).seed == 42
    topk = sampling_config(ex, SamplingParams(temperature=1.0, top_k=5))
    assert (topk.top_k, topk.top_p) == (5, None)
    pens = sampling_config(
        ex, SamplingParams(temperature=0, repetition_penalty=1.2, min_tokens=2, frequency_penalty=0.5)
    )
    assert (pens.repetition_penalty, pens.min_tokens, pens.frequency_penalty, pens.top_k) == (1.2, 2, 0.5, 1)


def test_kv_block_reuse_follows_the_cache_salt(double, engine: Path) -> None:
    prompt = list(range(5, 5 + 40))  # two full 16-token blocks and a partial one

    async def main() -> list[tuple[str, int]]:
        backend = TrtllmBackend(BackendConfig(engine_dir=str(engine)))
        backend.start(lambda healthy: None, lambda reason: None)
        core, seen = backend.executor.core, []
        enqueue = core.enqueue

        def spy(gen, req_id, arrival_time=None):  # the double's engine: what it was given, what it reused
            req = enqueue(gen, req_id, arrival_time)
            seen.append((gen.cache_salt, req))
            return req

        core.enqueue = spy
        for salt in ("a", "b", "", "a", ""):
            sampling = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
            [o async for o in backend.generate(GenerateRequest("x", prompt, sampling, cache_salt=salt))]
        await backend.shutdown(2)
        return [(salt, req.num_cached_tokens) for salt, req in seen]

    runs = asyncio.run(main())
    assert [cached for _, cached in runs] == [0, 0, 0, 32, 32]  # shared only with an earlier request's salt
    assert runs[0][0] == runs[3][0] != runs[1][0] and runs[2][0] == runs[4][0] == ""
    assert runs[0][0] == f"trtllm-salt-{cache_salt_id('a')}"  # the executor saw the id, not the salt


def test_perf_metrics_become_timing() -> None:
    def td(s: float) -> datetime.timedelta:
        return datetime.timedelta(seconds=s)

    timing = SimpleNamespace(arrival_time=td(100.0), first_scheduled_time=td(100.010), first_token_time=td(100.050),
                             last_token_time=td(100.250))  # fmt: skip
    result = SimpleNamespace(request_perf_metrics=SimpleNamespace(timing_metrics=timing))
    live = RemoteRequest(None, None, 99.9, token_times=[100.06, 100.11, 100.16, 100.21, 100.26])
    t = live.timing(TrtllmBackend._stamps(result), now=100.3, same_clock=True)
    assert t.source == "engine"
    assert t.queue_ms == pytest.approx(10) and t.prefill_ms == pytest.approx(40) and t.ttft_ms == pytest.approx(50)
    assert t.decode_ms == pytest.approx(200) and t.tpot_ms == pytest.approx(50) and t.e2e_ms == pytest.approx(250)
    assert t.itl_ms == pytest.approx((50, 50, 50, 50))
    edge = live.timing(TrtllmBackend._stamps(SimpleNamespace(request_perf_metrics=None)), now=100.3, same_clock=True)
    assert edge.source == "edge" and edge.ttft_ms == pytest.approx(160) and edge.e2e_ms == pytest.approx(400)


# ---- serving over gRPC ----------------------------------------------------------------------------------------


def _req(prompt: str = "Hello there", max_tokens: int = 16, **kw) -> llm_pb2.GenerateRequest:
    return llm_pb2.GenerateRequest(
        prompt=prompt,
        sampling=llm_pb2.SamplingParams(temperature=0),
        stopping=llm_pb2.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
        **kw,
    )


def _collect(stub, req, **kw):
    chunks, complete = generate(stub, req, **kw)
    return (*ids_and_text(chunks), complete)


def _wait_idle(srv) -> None:
    assert srv.idle(), "the executor kept requests or KV blocks"


def test_streams_equal_the_native_engine_on_the_same_weights(double, engine: Path) -> None:
    native_dir = next(engine.glob(".double-native-rank0"))  # our engine of the same fp16 export
    with running_server(engine) as trt, running_server(native_dir) as native:
        for prompt in ("Hello there", "The capital of France", "1 2 3 4"):
            a = _collect(trt.stub(), _req(prompt, 24))
            b = _collect(native.stub(), _req(prompt, 24))
            assert a[0] == b[0] and a[1] == b[1] and len(a[0]) == 24
            assert a[2].finish_reason == llm_pb2.FINISH_REASON_LENGTH and a[2].usage.completion_tokens == 24
            assert a[2].timing.ttft_ms > 0 and a[2].timing.tpot_ms > 0
        info = trt.stub().GetModelInfo(llm_pb2.GetModelInfoRequest())
        assert info.backend == "trtllm" and info.dtype == "float16" and info.max_seq_len == 512


def test_stop_strings_cancel_in_the_executor(double, engine: Path) -> None:
    with running_server(engine) as srv:
        _, text, _ = _collect(srv.stub(), _req(max_tokens=30))
        stop = text[4:7]
        req = _req(max_tokens=30)
        req.stopping.stop.append(stop)
        double.recorder.clear()
        _, cut, complete = _collect(srv.stub(), req)
        assert cut == text[: text.index(stop)] and complete.stop_string == stop
        assert complete.finish_reason == llm_pb2.FINISH_REASON_STOP
        assert double.recorder.called(f"{EXECUTOR}.Executor.cancel_request")
        _wait_idle(srv)


def test_error_response_is_unavailable_and_the_backend_stays_healthy(double, engine: Path) -> None:
    with running_server(engine) as srv:
        srv.server.backend.executor.fail_next_request("[TensorRT-LLM][ERROR] injected")
        with pytest.raises(grpc.RpcError) as err:
            _collect(srv.stub(), _req(request_id="bad-one"))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "bad-one" in err.value.details()
        assert "injected" not in err.value.details()
        assert len(_collect(srv.stub(), _req(max_tokens=5))[0]) == 5 and srv.server.backend.is_healthy


def test_cancel_and_deadline_cancel_in_the_executor(double, engine: Path) -> None:
    with running_server(engine) as srv:
        double.recorder.clear()
        call = srv.stub().Generate(_req(max_tokens=400))
        next(call)
        call.cancel()
        with srv.paced(min_step_s=0.002), pytest.raises(grpc.RpcError) as err:  # 450 tokens take over 0.9 s
            _collect(srv.stub(), _req(max_tokens=450), timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        _wait_idle(srv)
        assert len(double.recorder.called(f"{EXECUTOR}.Executor.cancel_request")) >= 2


def test_unsupported_fields_are_refused(double, engine: Path) -> None:
    with running_server(engine) as srv:
        min_p = _req()
        min_p.sampling.min_p = 0.05
        for req, field in ((_req(output=llm_pb2.OutputOptions(logprobs=3)), "output.logprobs"),
                           (_req(priority=2), "priority"), (min_p, "min_p")):  # fmt: skip
            with pytest.raises(grpc.RpcError) as err:
                _collect(srv.stub(), req)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
        ids, _, _ = _collect(srv.stub(), _req(max_tokens=4, output=llm_pb2.OutputOptions(logprobs=0)))
        assert len(ids) == 4


# ---- admission: what the executor would only fail ---------------------------------------------------------


def _ids_req(n: int, max_tokens: int = 4) -> llm_pb2.GenerateRequest:
    return llm_pb2.GenerateRequest(
        prompt_token_ids=llm_pb2.TokenIds(ids=[5 + i % 200 for i in range(n)]),
        sampling=llm_pb2.SamplingParams(temperature=0),
        stopping=llm_pb2.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
    )


@pytest.fixture(scope="module")
def short_input_engine(double, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trtllm") / "tiny-input-32"
    build("tiny-random", out, LIMITS, progress=False, backend="trtllm",
          trtllm=TrtllmOptions(dtype="float16", max_input_len=32))  # fmt: skip
    return out


def test_a_prompt_over_max_input_len_is_invalid_argument(double, short_input_engine: Path) -> None:
    """The executor would answer an error response (UNAVAILABLE); admission names the field instead."""
    assert load_trtllm_build_config(short_input_engine).max_input_len == 32  # TensorRT-LLM's config.json
    with running_server(short_input_engine) as srv:
        with pytest.raises(grpc.RpcError) as err:
            _collect(srv.stub(), _ids_req(33))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_input_len 32" in err.value.details() and "33 tokens" in err.value.details()
        assert len(_collect(srv.stub(), _ids_req(32))[0]) == 4  # the longest prompt it takes


def test_without_chunked_context_a_prompt_over_max_num_tokens_is_invalid_argument(double, engine: Path) -> None:
    unchunked = {"backend.trtllm": TrtllmConfig(enable_chunked_context=False)}
    with running_server(engine, **unchunked) as srv:
        with pytest.raises(grpc.RpcError) as err:
            _collect(srv.stub(), _ids_req(65))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_num_tokens 64" in err.value.details() and "--no-chunked-context" in err.value.details()
        assert len(_collect(srv.stub(), _ids_req(64))[0]) == 4
    with running_server(engine) as srv:  # chunked context (the default): prefilled in pieces
        assert len(_collect(srv.stub(), _ids_req(65))[0]) == 4
    build_cfg = TrtllmBuildConfig(max_input_len=512, max_seq_len=512, max_num_tokens=64, max_batch_size=8)
    assert PromptLimits.of(build_cfg, False, 32) == PromptLimits(512, 32)  # the runtime cap lowers it
    assert PromptLimits.of(build_cfg, True, 32) == PromptLimits(512, None)


def test_the_build_config_loader_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"build_config": {"max_input_len": 8}}))
    with pytest.raises(EngineFormatError, match=r"config\.json has no usable build_config"):
        load_trtllm_build_config(tmp_path)
    with pytest.raises(EngineFormatError, match=r"config\.json"):
        load_trtllm_build_config(tmp_path / "missing")


# ---- finish reasons -------------------------------------------------------------------------------------------


def test_the_finish_reason_map_is_every_real_member(double, monkeypatch) -> None:
    enum = double.executor.FinishReason
    assert [m.name for m in enum] == SURFACE[f"{EXECUTOR}.FinishReason"]["members"]  # the 1.2 surface's
    by_member = finish_reasons(enum)
    assert set(by_member) == set(enum)
    assert by_member[enum.END_ID] == by_member[enum.STOP_WORDS] == Stop("stop")
    assert by_member[enum.LENGTH] == Stop("length") and by_member[enum.NOT_FINISHED] is None
    assert by_member[enum.CANCELLED] == by_member[enum.TIMED_OUT] == Stop("abort")
    misspelt = {("END_IDS" if k == "END_ID" else k): v for k, v in FINISH_REASONS.items()}
    monkeypatch.setattr(trtllm_rules, "FINISH_REASONS", misspelt)
    with pytest.raises(BackendLoadError, match=r"not in FinishReason: \['END_IDS'\]; not mapped: \['END_ID'\]"):
        finish_reasons(enum)


def test_a_final_result_of_no_known_end_is_an_error_not_length(double) -> None:
    enum = double.executor.FinishReason
    by_member = finish_reasons(enum)
    for reasons in ([], None, [enum.NOT_FINISHED], ["LENGTH"]):  # a name is not the member
        with pytest.raises(UnknownFinishReason):
            finish_stop(by_member, SimpleNamespace(finish_reasons=reasons))
    assert finish_stop(by_member, SimpleNamespace(finish_reasons=[enum.LENGTH])) == Stop("length")


def _seeded_req(seed: int, ignore_eos: bool = True) -> llm_pb2.GenerateRequest:
    """The same 12 tokens for the same seed (sampled: greedy, the tiny model repeats one token)."""
    req = _req("1 2 3 4", 12)
    req.sampling.temperature, req.sampling.seed, req.stopping.ignore_eos = 1.0, seed, ignore_eos
    return req


def _ending_token(srv) -> tuple[int, list[int], int]:
    """A seed, its request's tokens and k >= 2: the index of a token that does not occur before it."""
    for seed in range(1, 40):
        ids, _, _ = _collect(srv.stub(), _seeded_req(seed))
        k = next((i for i in range(2, len(ids)) if ids[i] not in ids[:i]), None)
        if k is not None:
            return seed, ids, k
    raise AssertionError("no seed gives a fresh token after two")


@pytest.mark.parametrize("end_token_returned", [False, True])
def test_an_eos_end_is_stop(double, engine: Path, monkeypatch, end_token_returned: bool) -> None:
    """FinishReason.END_ID: TensorRT-LLM does not return the end token (NVIDIA/TensorRT-LLM#2190), so only the
    finish reason says EOS; should it return it, our stop rules see it. Either way: STOP, no stop token id."""
    monkeypatch.setattr(ExecutorDouble, "END_TOKEN_IN_OUTPUT", end_token_returned)
    with running_server(engine) as srv:
        seed, ids, k = _ending_token(srv)
        backend = srv.server.backend
        backend.end_ids = EndIds(ids[k], backend.end_ids.pad_id, (), frozenset({ids[k]}))  # ids[k] is the EOS
        double.recorder.clear()
        got, _, complete = _collect(srv.stub(), _seeded_req(seed, ignore_eos=False))
        assert got == ids[: k + 1 if end_token_returned else k]
        assert complete.finish_reason == llm_pb2.FINISH_REASON_STOP and complete.WhichOneof("stop_reason") is None
        assert complete.usage.completion_tokens == len(got)
        assert [r.end_id for r in double.recorder.built("Request")] == [ids[k]]
        _wait_idle(srv)


@pytest.mark.parametrize("stop_token_returned", [True, False])
def test_a_stop_token_end_is_stop(double, engine: Path, monkeypatch, stop_token_returned: bool) -> None:
    """FinishReason.STOP_WORDS for our stop_token_ids (sent as one-token stop words): with the token returned our
    rules end the request on it (its id reported); without it, the finish reason alone."""
    monkeypatch.setattr(ExecutorDouble, "STOP_WORD_IN_OUTPUT", stop_token_returned)
    with running_server(engine) as srv:
        seed, ids, k = _ending_token(srv)
        req = _seeded_req(seed)
        req.stopping.stop_token_ids.append(ids[k])
        got, _, complete = _collect(srv.stub(), req)
        assert complete.finish_reason == llm_pb2.FINISH_REASON_STOP
        if stop_token_returned:
            assert got == ids[: k + 1] and complete.stop_token_id == ids[k]
        else:
            assert got == ids[:k] and complete.WhichOneof("stop_reason") is None
        _wait_idle(srv)


def test_an_unknown_final_reason_fails_the_request(double, engine: Path, monkeypatch) -> None:
    """A final result whose reason is no end (here NOT_FINISHED) fails the request; it is never called LENGTH."""
    real = ExecutorDouble._response

    def wrong(self, out):
        response = real(self, out)
        if response.result.is_final:
            object.__setattr__(response.result, "finish_reasons", [self._namespace["FinishReason"].NOT_FINISHED])
        return response

    monkeypatch.setattr(ExecutorDouble, "_response", wrong)
    with running_server(engine) as srv:
        seed, ids, k = _ending_token(srv)  # these end by our rules (length): the executor's reason is not read
        backend = srv.server.backend
        backend.end_ids = EndIds(ids[k], backend.end_ids.pad_id, (), frozenset({ids[k]}))  # an EOS end: it is
        with pytest.raises(grpc.RpcError) as err:
            _collect(srv.stub(), _seeded_req(seed, ignore_eos=False))
        assert err.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
        assert srv.server.backend.is_healthy
        _wait_idle(srv)


def test_gauges_come_from_iteration_stats(double, engine: Path) -> None:
    with running_server(engine) as srv, srv.paced() as paced:
        call = srv.stub().Generate(_req(max_tokens=400))
        next(call)
        paced.hold()  # it keeps running (and holding blocks) while the gauges are read
        wait_until(
            lambda: srv.metric("llm_kv_cache_blocks_used") and srv.metric("llm_num_requests_running"),
            "gauges moved",
        )
        assert srv.metric("llm_kv_cache_blocks_total") == 256
        call.cancel()
        paced.release()
        _wait_idle(srv)
        wait_until(
            lambda: not srv.metric("llm_kv_cache_blocks_used") and not srv.metric("llm_num_requests_running"),
            "gauges back to zero after the cancel",
        )


@pytest.mark.parametrize("policy", ["exit", "recover"])
def test_a_dead_executor_fails_every_stream_then_the_policy(double, engine: Path, policy: str) -> None:
    with running_server(engine, on_engine_error=policy) as srv:
        with srv.paced() as paced:
            calls = [srv.stub().Generate(_req(f"stream {i}", max_tokens=400)) for i in range(3)]
            for c in calls:
                next(c)
            paced.hold()  # all three are still running when the executor dies
            srv.server.backend.executor.crash()
        for c in calls:
            with pytest.raises(grpc.RpcError) as err:
                list(c)
            assert err.value.code() == grpc.StatusCode.INTERNAL  # they had streamed output
        if policy == "exit":
            wait_until(lambda: srv.server.fatal, "the server marked fatal")
            assert "executor" in srv.server.fatal
        else:  # a new executor on the same engine; meanwhile UNAVAILABLE ("recovering"), which clients retry

            def serves() -> bool:
                try:
                    return len(_collect(srv.stub(), _req(max_tokens=6))[0]) == 6
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.UNAVAILABLE and "recovering" in err.details()
                    return False

            wait_until(serves, "serving again after the recovery")
            assert srv.server.fatal is None


def test_recover_drops_the_old_executor_before_building_the_next(double, engine: Path, monkeypatch) -> None:
    """The old executor's shutdown() has returned and nothing references it (its GPU memory can be freed) before
    the next Executor is constructed."""
    with running_server(engine, on_engine_error="recover") as srv:
        backend = srv.server.backend
        old = weakref.ref(backend.executor)
        double.recorder.clear()  # the recorder keeps every object the double built: not a reference of ours
        seen: list[tuple[bool, int]] = []
        build_next = backend._new_executor

        def checked():
            gc.collect()
            seen.append((old() is None, len(double.recorder.called(f"{EXECUTOR}.Executor.shutdown"))))
            return build_next()

        monkeypatch.setattr(backend, "_new_executor", checked)
        backend.executor.crash()
        wait_until(lambda: seen, "the next executor being built")
        assert seen == [(True, 1)]  # the old one was shut down once and is gone
        wait_until(lambda: backend.executor is not None and backend.is_healthy, "the new executor serving")

        def serves() -> bool:
            try:
                return len(_collect(srv.stub(), _req(max_tokens=6))[0]) == 6
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE
                return False

        wait_until(serves, "serving on the new executor")


def test_drain_cut_cancels_in_the_executor(double, engine: Path) -> None:
    with running_server(engine) as srv, srv.paced() as paced:
        double.recorder.clear()
        call = srv.stub().Generate(_req(max_tokens=450))
        next(call)
        paced.hold()  # it cannot finish before the drain timeout, on any machine
        drain = asyncio.run_coroutine_threadsafe(srv.server.drain_and_stop(0.2), srv.loop)
        wait_until(lambda: srv.server.edge.cut, "the drain timeout")
        paced.release()
        drain.result(timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.ABORTED
        assert double.recorder.called(f"{EXECUTOR}.Executor.cancel_request")
        assert double.recorder.called(f"{EXECUTOR}.Executor.shutdown")


# ---- the image's start-up smoke test --------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def _entrypoint(tmp_path: Path, *, fake_version: str | None, skip: bool = False) -> subprocess.CompletedProcess:
    """docker/trtllm-entrypoint.sh as the container runs it; fake_version: a stand-in tensorrt_llm package of that
    version on PYTHONPATH (None: none, as on this machine)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LLM_SKIP_SMOKE_TEST": "1" if skip else "0"}
    if fake_version is not None:
        pkg = tmp_path / "fake" / "tensorrt_llm"
        (pkg / "bindings").mkdir(parents=True)
        (pkg / "__init__.py").write_text(f"__version__ = {fake_version!r}\n")
        (pkg / "bindings" / "__init__.py").write_text("")
        (pkg / "bindings" / "executor.py").write_text("")
        env["PYTHONPATH"] = f"{tmp_path / 'fake'}{os.pathsep}{ROOT}"
    script = ROOT / "docker" / "trtllm-entrypoint.sh"
    return subprocess.run(["sh", str(script), "echo", "the command ran"], env=env, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip


def test_the_image_checks_tensorrt_llm_when_it_starts_not_when_it_is_built(tmp_path: Path) -> None:
    dockerfile = (ROOT / "docker" / "Dockerfile.trtllm").read_text()
    steps = [line for line in dockerfile.splitlines() if line.startswith(("RUN", "    &&"))]
    assert steps and not any("tensorrt_llm" in line for line in steps)  # no docker build step imports it
    assert 'ENTRYPOINT ["trtllm-entrypoint"]' in dockerfile
    missing = _entrypoint(tmp_path, fake_version=None)
    assert (
        missing.returncode == 2 and "cannot be imported" in missing.stderr and "the command ran" not in missing.stdout
    )
    ok = _entrypoint(tmp_path, fake_version="1.2.1")
    assert ok.returncode == 0 and "smoke test: TensorRT-LLM 1.2.1" in ok.stderr and ok.stdout == "the command ran\n"
    other = _entrypoint(tmp_path / "o", fake_version="1.3.0")
    assert other.returncode == 2 and "written for 1.2.1" in other.stderr
    skipped = _entrypoint(tmp_path, fake_version=None, skip=True)
    assert skipped.returncode == 0 and skipped.stdout == "the command ran\n"


# ---- conformance ------------------------------------------------------------------------------------------------


def _exercise_everything(engine: Path, tmp: Path, recorder) -> None:
    """Every path of the builder and the backend that calls into TensorRT-LLM."""
    for options in (TrtllmOptions(), TrtllmOptions(weight_only="int4"), TrtllmOptions(tp_size=2)):
        build("tiny-random", tmp / f"{options.weight_only}-{options.tp_size}", LIMITS, progress=False,
              backend="trtllm", trtllm=options)  # fmt: skip

    async def serve() -> None:
        backend = TrtllmBackend(
            BackendConfig(engine_dir=str(engine), trtllm=TrtllmConfig(scheduler_policy="max_utilization"))
        )
        backend.start(lambda healthy: None, lambda reason: None)
        kinds = [SamplingParams(max_tokens=3, temperature=0, stop_token_ids=(7,), min_tokens=1),
                 SamplingParams(max_tokens=3, temperature=0.8, top_k=4, top_p=0.9, seed=1,
                                repetition_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.1, logprobs=0),
                 SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True),
                 *(SamplingParams(max_tokens=3, temperature=0, constraint=c) for c in (
                     Constraint("json_object"), Constraint("json_schema", '{"type": "object"}'),
                     Constraint("regex", "[ab]+"), Constraint("gbnf", 'root ::= "a"'),
                     Constraint("choice", choices=("a", "b"))))]  # fmt: skip
        # (structural_tag: GuidedDecodingParams is built in tests/test_trtllm_guided.py; the native engine standing
        # in for TensorRT-LLM's refuses to run it)
        for sampling in kinds:
            [o async for o in backend.generate(GenerateRequest("x", [5, 6], sampling))]
        stream = backend.generate(GenerateRequest("c", [5, 6], SamplingParams(max_tokens=200, ignore_eos=True)))
        await stream.__anext__()
        await stream.aclose()  # cancel_request
        polled = f"{EXECUTOR}.Executor.get_latest_iteration_stats"
        await wait_until_async(lambda: recorder.called(polled), "a stats poll")
        await backend.shutdown(2)

    asyncio.run(serve())


def test_everything_our_code_touches_exists_in_the_real_surface(double, engine: Path, tmp_path: Path) -> None:
    double.recorder.seen.clear()
    _exercise_everything(engine, tmp_path, double.recorder)
    touched = set(double.recorder.seen)
    unknown = sorted(n for n in touched if n not in known_names())
    assert not unknown, f"not in the 1.2 surface nor the allow-list: {unknown}"
    expected = {"tensorrt_llm.bindings.executor.Request(stop_words=)", "tensorrt_llm.BuildConfig(plugin_config=)",
                "tensorrt_llm.bindings.executor.Request(cache_salt_id=)",
                "tensorrt_llm.Mapping(tp_size=)", "tensorrt_llm.models.modeling_utils.QuantConfig(quant_algo=)",
                "tensorrt_llm.bindings.executor.Executor.cancel_request",
                "tensorrt_llm.bindings.executor.Executor.get_latest_iteration_stats",
                "tensorrt_llm.bindings.executor.SamplingConfig(top_p=)",
                f"{EXECUTOR}.Request(guided_decoding_params=)", f"{EXECUTOR}.ExecutorConfig(guided_decoding_config=)",
                f"{EXECUTOR}.GuidedDecodingParams(guide_type=)", f"{EXECUTOR}.GuidedDecodingParams(guide=)",
                *(f"{EXECUTOR}.GuidedDecodingConfig({k}=)"
                  for k in ("backend", "encoded_vocab", "tokenizer_str", "stop_token_ids"))}  # fmt: skip
    assert expected <= touched  # the exercise really went through these paths
    assert f"{EXECUTOR}.SamplingConfig(min_p=)" not in touched  # refused, never sent (docs/gpu.md)
    top_level = {n for n in touched if n.count(".") == 1 and "(" not in n}
    assert top_level - set(SURFACE) - set(PARTIAL) <= set(ALLOW_LIST)


def test_the_double_is_the_surface(double) -> None:
    ex = double.executor
    for qualname, entry in SURFACE.items():
        if qualname.startswith("_") or entry["kind"] not in ("class", "enum"):
            continue
        module, _, name = qualname.rpartition(".")
        owner = double.modules.get(module) or getattr(
            double.modules[module.rpartition(".")[0]], module.rpartition(".")[2]
        )
        obj = getattr(owner, name)
        if entry["kind"] == "enum":
            assert [m.name for m in obj] == entry["members"], qualname
        elif entry.get("init"):
            assert inspect.signature(obj) == signature(entry["init"]), qualname
    with pytest.raises(TypeError):
        ex.Request([1, 2], 5, max_new_tokens=3)  # the typo the issue names
    with pytest.raises(TypeError):
        ex.SamplingConfig(1, 5)  # top_k is keyword-only
    with pytest.raises(AttributeError):
        ex.FinishReason.STOPPED  # noqa: B018


def test_backend_runs_in_an_event_loop_without_grpc(double, engine: Path) -> None:
    async def main() -> list:
        backend = TrtllmBackend(BackendConfig(engine_dir=str(engine), admission=AdmissionConfig(max_queue=4)))
        backend.start(lambda healthy: None, lambda reason: None)
        outs = [
            o async for o in backend.generate(GenerateRequest("x", [5, 6], SamplingParams(max_tokens=3, temperature=0)))
        ]
        await backend.shutdown(2)
        return outs

    outs = asyncio.run(main())
    assert sum(len(o.new_token_ids) for o in outs) == 3 and outs[-1].finished and outs[-1].timing.source == "engine"
