"""The Triton front door (--triton-port) against the native backend, driven by plain tritonclient scripts over
real gRPC: the same text as llm.v1, the ensemble contract (tensors, configs, decoupled rules), perf metrics,
validation, cancellation, and an attacker's inputs. Every test ends with every KV block back."""

from __future__ import annotations

import struct
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tg
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from build_engine.triton_models.tables import MODELS
from protos.llm.v1 import llm_pb2
from tests.engines import build_tiny
from tests.servers import ServerThread, generate, ids_and_text, make_config, running_server
from tests.triton_clients import Streamer, inputs, is_final, stream_once, tensor
from tests.waiting import wait_until

pytestmark = pytest.mark.server

PROMPTS = ("Hello there", "The capital of France is", "Once upon a time, in a land", "1, 2, 3, 4,")


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 48 sequences per step: the 40 streams of the cancellation test all generate at once
    return build_tiny(tmp_path_factory, "tiny-triton", max_batch_size=48, max_num_tokens=64, max_seq_len=1024)


@pytest.fixture(scope="module")
def server(engine_dir: Path):
    with running_server(engine_dir, triton_port=0) as s:
        yield s


@pytest.fixture
def url(server: ServerThread) -> str:
    yield f"127.0.0.1:{server.server.triton_port}"
    assert server.idle(), "a request is still in flight or holds KV blocks"


def _llm(server: ServerThread, prompt: str, max_tokens: int, **sampling) -> tuple[str, list[int], llm_pb2.Complete]:
    req = llm_pb2.GenerateRequest(
        prompt=prompt,
        sampling=llm_pb2.SamplingParams(**({"temperature": 0} | sampling)),
        stopping=llm_pb2.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    chunks, complete = generate(server.stub(), req, timeout=60)
    ids, text = ids_and_text(chunks)
    return text, ids, complete


def _ensemble(prompt: str, max_tokens: int, **extra) -> list:
    return inputs("ensemble", text_input=prompt, max_tokens=max_tokens, stream=True, end_id=-1, **extra)


# ---- the Must-show checks ------------------------------------------------------------------------------------
# the tiny random model's greedy text repeats one character; seeded sampling at a high temperature gives varied
# text (partial UTF-8 sequences included), which exercises the detokenizer on both paths
VARIED = {"temperature": 10.0, "seed": 7}


def test_streamed_text_equals_llm_v1(server: ServerThread, url: str) -> None:
    for i, prompt in enumerate(PROMPTS):
        run = stream_once(url, "ensemble", _ensemble(prompt, 24, top_k=1, return_num_output_tokens=True), f"r{i}")
        text, ids, _ = _llm(server, prompt, 24)
        assert not run.errors and run.text == text
        varied = stream_once(url, "ensemble", _ensemble(prompt, 24, top_p=1.0, **VARIED))
        assert varied.text == _llm(server, prompt, 24, **VARIED)[0] and len(set(varied.text)) > 5
        assert run.total("num_output_tokens") == len(ids) == 24  # per response, as TensorRT-LLM counts
        assert [r.get_response().id for r in run.results] == [f"r{i}"] * len(run.results)  # the id is echoed
        finals = [r.get_response().parameters["triton_final_response"].bool_param for r in run.results]
        assert finals[-1] and not any(finals[:-1])


def test_unary_model_infer_returns_the_whole_text(server: ServerThread, url: str) -> None:
    client = tg.InferenceServerClient(url)
    prompt = PROMPTS[1]
    text, ids, _ = _llm(server, prompt, 20)
    tensors = inputs("ensemble_sync", text_input=prompt, max_tokens=20, end_id=-1, exclude_input_in_output=True)
    result = client.infer("ensemble_sync", tensors)
    assert b"".join(result.as_numpy("text_output").reshape(-1)).decode() == text
    with_prompt = client.infer("ensemble_sync", inputs("ensemble_sync", text_input=prompt, max_tokens=20, end_id=-1))
    assert b"".join(with_prompt.as_numpy("text_output").reshape(-1)).decode() == prompt + text  # TensorRT-LLM's default
    # the token model, unary: prompt ids + output ids unless excluded
    prompt_ids = list(server.stub().Tokenize(llm_pb2.TokenizeRequest(text=prompt)).token_ids)
    tok = client.infer(
        "tensorrt_llm_sync",
        inputs("tensorrt_llm_sync", input_ids=prompt_ids, input_lengths=len(prompt_ids), request_output_len=20),
    )
    assert tok.as_numpy("output_ids").reshape(-1).tolist() == prompt_ids + ids
    assert tok.as_numpy("sequence_length").reshape(-1).tolist() == [len(prompt_ids) + 20]
    # ModelInfer on a decoupled model is refused exactly as Triton refuses it
    with pytest.raises(InferenceServerException) as err:
        client.infer("ensemble", inputs("ensemble", text_input=prompt, max_tokens=4))
    assert err.value.status() == "StatusCode.UNIMPLEMENTED"
    assert err.value.message() == "ModelInfer RPC doesn't support models with decoupled transaction policy"
    with pytest.raises(InferenceServerException, match="Streaming is only supported in decoupled mode"):
        client.infer("ensemble_sync", inputs("ensemble_sync", text_input=prompt, max_tokens=4, stream=True))


def test_perf_metrics_are_consistent(url: str) -> None:
    start = time.monotonic_ns()
    run = stream_once(url, "ensemble", _ensemble(PROMPTS[2], 16, return_perf_metrics=True))
    end = time.monotonic_ns()
    arrival, scheduled, first, last = (
        run.scalar(n)
        for n in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")
    )
    assert start <= arrival <= scheduled <= first <= last <= end  # steady-clock ns, as TensorRT-LLM reports
    assert last > first  # 16 tokens took some time


def test_bad_temperature_is_refused_naming_it(url: str) -> None:
    run = stream_once(url, "ensemble", _ensemble("Hi", 8, temperature=-1.0))
    assert not run.results and len(run.errors) == 1
    assert "temperature" in run.errors[0].message() and "-1.0" in run.errors[0].message()
    with pytest.raises(InferenceServerException) as err:
        tg.InferenceServerClient(url).infer(
            "ensemble_sync", inputs("ensemble_sync", text_input="Hi", max_tokens=8, temperature=float("nan"))
        )
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT" and "temperature" in err.value.message()


def test_cancelling_40_streams_mid_flight_frees_every_kv_block(server: ServerThread, url: str) -> None:
    cancelled_before = _metric(server, "CANCELLED")
    backend = server.server.backend
    with server.paced() as paced:
        paced.hold()  # the engine runs one step at a time below: no request can finish
        streamers = [Streamer(url) for _ in range(40)]
        for i, s in enumerate(streamers):
            s.send("ensemble", _ensemble(PROMPTS[i % 4], 990), f"c{i}")
        wait_until(lambda: backend.num_in_flight == 40, "all 40 admitted")
        reqs = backend.core.scheduler.requests
        paced.step_until(lambda: len(reqs) == 40 and all(r.output_token_ids for r in reqs.values()))
        started = [s for s in streamers if s.queue.get(timeout=60)[1] is None]  # each has streamed output...
        assert len(started) == 40 and backend.num_in_flight == 40  # ...and none has finished
        assert backend.core.kv.pool.num_used_blocks > 0  # ...and holds blocks
        for s in streamers:
            s.close(cancel=True)
    assert server.idle()  # every block back
    wait_until(lambda: _metric(server, "CANCELLED") >= cancelled_before + 40, "40 counted as CANCELLED")
    assert _metric(server, "CANCELLED") == cancelled_before + 40


def _metric(server: ServerThread, code: str, model: str = "ensemble") -> float:
    try:
        return server.metric("llm_triton_requests_total", f'code="{code}",model="{model}"')
    except KeyError:
        return 0.0


# ---- the contract -------------------------------------------------------------------------------------------
def test_health_metadata_and_configs_describe_the_ensemble(url: str) -> None:
    client = tg.InferenceServerClient(url)
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert "model_configuration" in meta.extensions and "statistics" in meta.extensions
    for name, spec in MODELS.items():
        assert client.is_model_ready(name) and client.is_model_ready(name, "1")
        md = client.get_model_metadata(name)
        assert md.versions == ["1"]
        assert {(t.name, t.datatype, tuple(t.shape)) for t in md.inputs} == {
            (t.name, t.datatype, (-1, *t.dims)) for t in spec.served_inputs
        }
        # the config survives a round trip through Triton's own text format (what a config.pbtxt holds)
        cfg = client.get_model_config(name).config
        assert text_format.Parse(text_format.MessageToString(cfg), model_config_pb2.ModelConfig()) == cfg
        assert cfg.name == name and cfg.max_batch_size >= 1
    assert not client.is_model_ready("nope") and not client.is_model_ready("ensemble", "2")
    ens = client.get_model_config("ensemble").config
    assert ens.platform == "ensemble" and ens.model_transaction_policy.decoupled
    assert not client.get_model_config("ensemble_sync").config.model_transaction_policy.decoupled
    required = {i.name for i in ens.input if not i.optional}
    assert required == {"text_input", "max_tokens"}
    types = {i.name: (i.data_type, list(i.dims)) for i in ens.input}
    assert types["text_input"] == (model_config_pb2.TYPE_STRING, [1])
    assert types["stop_words"] == (model_config_pb2.TYPE_STRING, [-1])
    assert types["seed"] == (model_config_pb2.TYPE_UINT64, [1])
    # every step exists, reads what the ensemble or an earlier step provides, and feeds the next
    available = {i.name for i in ens.input}
    for step in ens.ensemble_scheduling.step:
        step_cfg = client.get_model_config(step.model_name).config
        assert set(step.input_map) <= {i.name for i in step_cfg.input}
        assert set(step.input_map.values()) <= available, step.model_name
        assert set(step.output_map) <= {o.name for o in step_cfg.output}
        available |= set(step.output_map.values())
    assert {o.name for o in ens.output} <= available
    llm = client.get_model_config("tensorrt_llm").config
    assert llm.backend == "tensorrtllm" and llm.model_transaction_policy.decoupled
    assert llm.parameters["gpt_model_type"].string_value == "inflight_fused_batching"
    assert llm.parameters["llm_backend"].string_value == "native"
    with pytest.raises(InferenceServerException) as err:
        client.get_model_config("nope")
    assert err.value.status() == "StatusCode.NOT_FOUND" and "'nope'" in err.value.message()
    pre = client.infer(  # the steps run on their own (tests/test_triton_conformance.py chains them)
        "preprocessing", [tensor("preprocessing", "QUERY", "hi"), tensor("preprocessing", "REQUEST_OUTPUT_LEN", 2)]
    )
    assert pre.as_numpy("REQUEST_OUTPUT_LEN").tolist() == [[2]]


def test_token_model_streams_the_llm_v1_token_ids(server: ServerThread, url: str) -> None:
    prompt = PROMPTS[3]
    _, ids, complete = _llm(server, prompt, 20)
    prompt_ids = list(server.stub().Tokenize(llm_pb2.TokenizeRequest(text=prompt)).token_ids)
    run = stream_once(
        url,
        "tensorrt_llm",
        inputs(
            "tensorrt_llm", input_ids=prompt_ids + [0, 0], input_lengths=len(prompt_ids), request_output_len=20,
            streaming=True, runtime_top_k=1, return_num_input_tokens=True, return_num_output_tokens=True,
        ),
    )  # fmt: skip
    assert not run.errors and run.ids == ids  # input_ids past input_lengths (padding) are not the prompt
    assert sum(r.as_numpy("sequence_length").reshape(-1)[0] for r in run.results) == 20  # per response
    assert run.scalar("num_input_tokens") == complete.usage.prompt_tokens == len(prompt_ids)


def test_sampling_follows_tensorrt_llm(server: ServerThread, url: str) -> None:
    prompt = PROMPTS[0]
    greedy, _, _ = _llm(server, prompt, 16)
    # TensorRT-LLM is greedy without top_k / top_p, whatever the temperature
    assert stream_once(url, "ensemble", _ensemble(prompt, 16, temperature=1.5)).text == greedy
    assert stream_once(url, "ensemble", _ensemble(prompt, 16, top_k=1, top_p=0.5, **VARIED)).text == greedy
    # with top_p (or top_k > 1) the temperature samples, and a seed reproduces llm.v1's sampled text exactly
    sampled, _, _ = _llm(server, prompt, 16, **VARIED)
    assert sampled != greedy
    assert stream_once(url, "ensemble", _ensemble(prompt, 16, top_p=1.0, **VARIED)).text == sampled
    top_k, _, _ = _llm(server, prompt, 16, top_k=5, **VARIED)
    assert stream_once(url, "ensemble", _ensemble(prompt, 16, top_k=5, **VARIED)).text == top_k


def test_stop_words_are_stop_strings_and_bad_words_are_refused(server: ServerThread, url: str) -> None:
    prompt = PROMPTS[1]
    full, _, _ = _llm(server, prompt, 30, **VARIED)
    stop = full[10:13]
    cut = full[: full.index(stop)]
    assert cut
    run = stream_once(url, "ensemble", _ensemble(prompt, 30, top_p=1.0, stop_words=[stop, ""], **VARIED))
    assert run.text == cut
    bad = stream_once(url, "ensemble", _ensemble(prompt, 8, bad_words=["x"]))
    assert bad.errors and "bad_words is not supported" in bad.errors[0].message()


def test_statistics_and_metrics_count_triton_requests(server: ServerThread, url: str) -> None:
    client = tg.InferenceServerClient(url)
    before = client.get_inference_statistics("ensemble").model_stats[0]
    ok_before = server.metric("llm_requests_total", 'code="OK"')
    for _ in range(3):
        stream_once(url, "ensemble", _ensemble("Hi", 4))
    stream_once(url, "ensemble", _ensemble("Hi", 0))  # refused: max_tokens must be >= 1
    after = client.get_inference_statistics("ensemble").model_stats[0]
    assert after.inference_stats.success.count == before.inference_stats.success.count + 3
    assert after.inference_stats.fail.count == before.inference_stats.fail.count + 1
    assert server.metric("llm_requests_total", 'code="OK"') == ok_before + 3  # the same series as llm.v1


# ---- an attacker's inputs -------------------------------------------------------------------------------------
def _raw_stream(url: str, messages: list[bytes], timeout: float = 30) -> list[service_pb2.ModelStreamInferResponse]:
    """Raw bytes on ModelStreamInfer (malformed protobuf included), every response read."""
    channel = grpc.insecure_channel(url)
    call = channel.stream_stream(
        "/inference.GRPCInferenceService/ModelStreamInfer",
        request_serializer=lambda b: b,
        response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
    )
    try:
        return list(call(iter(messages), timeout=timeout))
    finally:
        channel.close()


def _request(model: str = "ensemble", request_id: str = "", **tensors) -> service_pb2.ModelInferRequest:
    """A ModelInferRequest by hand: name -> (datatype, shape, raw bytes)."""
    req = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for name, (datatype, shape, raw) in tensors.items():
        req.inputs.add(name=name, datatype=datatype, shape=shape)
        req.raw_input_contents.append(raw)
    return req


def _bytes(*values: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def _i32(*values: int) -> bytes:
    return np.array(values, dtype=np.int32).tobytes()


GOOD = {"text_input": ("BYTES", [1, 1], _bytes(b"Hello")), "max_tokens": ("INT32", [1, 1], _i32(4))}


def test_attacks_get_clear_errors_and_leak_nothing(server: ServerThread, url: str) -> None:
    cases = {
        "wrong datatype": (_request(**{**GOOD, "max_tokens": ("FP32", [1, 1], np.float32(4).tobytes())}),
                           "unexpected datatype FP32 for inference input 'max_tokens', expecting INT32"),
        "wrong shape": (_request(**{**GOOD, "max_tokens": ("INT32", [1, 2], _i32(4, 4))}),
                        "unexpected shape for input 'max_tokens'"),
        "batch of two": (_request(**{**GOOD, "max_tokens": ("INT32", [2, 1], _i32(4, 4))}), "batch size 2"),
        "missing input": (_request(text_input=GOOD["text_input"]), "missing required input(s) 'max_tokens'"),
        "unknown input": (_request(**GOOD, bogus=("INT32", [1, 1], _i32(1))), "unexpected inference input 'bogus'"),
        "short contents": (_request(**{**GOOD, "max_tokens": ("INT32", [1, 1], b"\x01\x00")}), "need 4"),
        "length past end": (_request(**{**GOOD, "text_input": ("BYTES", [1, 1], struct.pack("<I", 99) + b"x")}),
                            "runs past the contents"),
        "invalid UTF-8": (_request(**{**GOOD, "text_input": ("BYTES", [1, 1], _bytes(b"\xff\xfe"))}),
                          "text_input is not valid UTF-8"),
        "huge text": (_request(**{**GOOD, "text_input": ("BYTES", [1, 1], _bytes(b"a" * 3_000_000))}),
                      "text_input is 3000000 bytes"),
        "negative shape": (_request(**{**GOOD, "max_tokens": ("INT32", [1, -1], b"")}), "unexpected shape"),
        "unknown model": (_request("nope", **GOOD), "Request for unknown model: 'nope' is not found"),
        "long id": (_request(request_id="x" * 2000, **GOOD), "longer than 1024 bytes"),
        "long list": (_request(**GOOD, stop_words=("BYTES", [1, 5000], _bytes(*[b""] * 5000))),
                      "input 'stop_words' has 5000 elements, more than 256"),
        "bad empty-final parameter": (None, "expected bool_param"),
    }  # fmt: skip
    bad_param = _request(**GOOD)
    bad_param.parameters["triton_enable_empty_final_response"].string_param = "yes"
    cases["bad empty-final parameter"] = (bad_param, cases["bad empty-final parameter"][1])
    duplicate = _request(**GOOD)
    duplicate.inputs.add(name="max_tokens", datatype="INT32", shape=[1, 1])
    duplicate.raw_input_contents.append(_i32(4))
    cases["duplicate input"] = (duplicate, "given more than once")
    fewer_raw = _request(**GOOD)
    del fewer_raw.raw_input_contents[1]
    cases["raw count"] = (fewer_raw, "expected 2 raw input contents")
    unknown_output = _request(**GOOD)
    unknown_output.outputs.add(name="logits")
    cases["unknown output"] = (unknown_output, "unexpected inference output 'logits'")
    messages = [case.SerializeToString() for case, _ in cases.values()]
    messages.append(b"\x0a\xff\xff\xff\xff\x0f")  # a truncated length-delimited field: not a message at all
    messages.append(b"\x0a\x08ensemble\x1a\x02\xff\xfe")  # a request id that is not UTF-8
    ok = _request(request_id="ok", **GOOD)
    ok.parameters["triton_enable_empty_final_response"].bool_param = True
    messages.append(ok.SerializeToString())  # the stream is still usable after all of that
    responses = _raw_stream(url, messages)
    errors = [r.error_message for r in responses if r.error_message]
    assert len(errors) == len(cases) + 2
    for name, (_, expected) in cases.items():
        assert any(expected in e for e in errors), f"{name}: no error containing {expected!r} in {errors}"
    assert "request is not a valid inference.ModelInferRequest message" in errors
    assert "id is not valid UTF-8" in errors
    good = [r.infer_response for r in responses if not r.error_message]
    assert good and good[-1].id == "ok" and good[-1].parameters["triton_final_response"].bool_param
    assert server.idle()


def test_unary_attacks_are_status_errors(url: str) -> None:
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(url))
    bad = _request("ensemble_sync", **{**GOOD, "max_tokens": ("INT32", [1, 1], _i32(-3))})
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(bad, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens must be >= 1" in err.value.details()
    raw = grpc.insecure_channel(url).unary_unary(
        "/inference.GRPCInferenceService/ModelInfer", request_serializer=lambda b: b
    )
    with pytest.raises(grpc.RpcError) as err:
        raw(b"\x0a\xff\xff\xff\xff\x0f", timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        stub.RepositoryModelLoad(service_pb2.RepositoryModelLoadRequest(model_name="ensemble"), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_value_errors_name_the_tensor(server: ServerThread, url: str) -> None:
    ens = {
        "top_p": ({"top_p": 2.0}, "top_p must be in (0, 1]"),
        "min_tokens": ({"min_tokens": 9}, "min_tokens must be in [0, max_tokens=8]"),
        "seed": ({"seed": 2**63}, "seed must be in [0, 2^63 - 1]"),
        "penalty": ({"presence_penalty": 5.0}, "presence_penalty must be in [-2, 2]"),
        "beam": ({"beam_width": 2}, "beam_width=2 is not supported"),
        "logits": ({"return_context_logits": True}, "return_context_logits=True is not supported"),
        "stop words": ({"stop_words": [f"s{i}" for i in range(17)]}, "stop_words allows at most 16"),
        "end id": ({"end_id": 100_000}, "end_id must be -1 (no end token) or a token id in [0, 267)"),
        "too long": ({"max_tokens": 5000}, "exceeds max_seq_len"),
    }
    for name, (extra, expected) in ens.items():
        tensors = inputs("ensemble", **{"text_input": "Hi", "max_tokens": 8, "stream": True, **extra})
        run = stream_once(url, "ensemble", tensors)
        assert run.errors and expected in run.errors[0].message(), (name, [e.message() for e in run.errors])
    trt = {
        "top_k": ({"runtime_top_k": -1}, "runtime_top_k must be >= 0"),
        "length": ({"request_output_len": 5000}, "request_output_len (5000)"),
        "vocab": ({"input_ids": [1, 999], "input_lengths": 2}, "input_ids contains token id 999"),
        "lengths": ({"input_lengths": 5}, "input_lengths must be in [1, 2]"),
        "stop words": ({"stop_words_list": [[5, 6], [2, -1]]}, "only single-token stop words"),
        "bad words": ({"bad_words_list": [[5], [1]]}, "bad_words_list is not supported"),
    }
    for name, (extra, expected) in trt.items():
        values = {"input_ids": [5, 6], "input_lengths": 2, "request_output_len": 8, "streaming": True, **extra}
        run = stream_once(url, "tensorrt_llm", inputs("tensorrt_llm", **values))
        assert run.errors and expected in run.errors[0].message(), (name, [e.message() for e in run.errors])


def test_a_reused_id_never_reaches_another_stream(server: ServerThread, url: str) -> None:
    """Two streams send id "x" at once; a stop for "x" on one ends only its own request."""
    text = {p: _llm(server, p, 40)[0] for p in PROMPTS[:2]}
    a, b = Streamer(url), Streamer(url)
    try:
        for s, prompt in ((a, PROMPTS[0]), (b, PROMPTS[1])):
            s.send("ensemble", _ensemble(prompt, 40, top_k=1), "x")
        ra, rb = a.read(), b.read()
        assert (ra.text, rb.text) == (text[PROMPTS[0]], text[PROMPTS[1]])
        # the same id twice on one stream: both run to the end, each with all its tokens
        a.send("ensemble", _ensemble(PROMPTS[0], 10, return_num_output_tokens=True), "same")
        a.send("ensemble", _ensemble(PROMPTS[1], 10, return_num_output_tokens=True), "same")
        both = a.read(n_final=2)
        assert not both.errors and both.total("num_output_tokens") == 20
        # a stop request ends the requests with its id on its own stream only
        trt = {"input_ids": [5, 6, 7], "input_lengths": 3, "request_output_len": 900, "streaming": True}
        with server.paced() as paced:
            a.send("tensorrt_llm", inputs("tensorrt_llm", **trt), "y")
            b.send("tensorrt_llm", inputs("tensorrt_llm", **trt), "y")
            assert a.queue.get(timeout=30)[1] is None and b.queue.get(timeout=30)[1] is None  # both generate
            paced.hold()  # neither can finish on its own from here
            a.send("tensorrt_llm", inputs("tensorrt_llm", **trt, stop=True), "y")
            stopped = a.read(n_final=2, timeout=30)  # the stopped request's final, then the stop's empty final
            assert not stopped.errors and all(r.get_response().id == "y" for r in stopped.results)
            wait_until(lambda: server.server.backend.num_in_flight == 1, "a's request gone")
            while not b.queue.empty():  # b's "y" is still generating: nothing final, no error
                result, error = b.queue.get()
                assert error is None and not is_final(result)
    finally:
        a.close(cancel=True)
        b.close(cancel=True)


def test_empty_final_response_only_when_asked(url: str) -> None:
    """A stop request has nothing to return: an output-less final response iff it asked for one."""
    trt = {"input_ids": [5], "input_lengths": 1, "request_output_len": 1, "stop": True}
    s = Streamer(url)
    try:
        s.send("tensorrt_llm", inputs("tensorrt_llm", **trt), "q", empty_final=False)
        s.send("tensorrt_llm", inputs("tensorrt_llm", **trt), "r", empty_final=True)
        s.send("tensorrt_llm", inputs("tensorrt_llm", **trt), "marker", empty_final=True)
        run = s.read(n_final=2)  # "q" answered nothing before the requests sent after it
        assert [r.get_response().id for r in run.results] == ["r", "marker"]
        assert not run.results[0].get_response().outputs
    finally:
        s.close()


def test_rpc_limit_covers_triton_requests(engine_dir: Path) -> None:
    with running_server(engine_dir, triton_port=0, max_concurrent_rpcs=2, max_rpcs_per_connection=2) as srv:
        url = f"127.0.0.1:{srv.server.triton_port}"
        s = Streamer(url)
        try:
            for i in range(3):
                s.send("ensemble", _ensemble("Hi", 600), f"n{i}")
            _, error = s.queue.get(timeout=30)
            while error is None:
                _, error = s.queue.get(timeout=30)
            assert "too many RPCs in flight (limit 2)" in error.message()
            assert tg.InferenceServerClient(url).is_server_ready()  # health checks still answer
        finally:
            s.close(cancel=True)


def test_drain_lets_triton_streams_finish(engine_dir: Path) -> None:
    """A request in flight finishes; an idle open stream does not hold the drain up (it is ended, not waited for
    until the drain timeout)."""
    srv = ServerThread(make_config(engine_dir, triton_port=0)).start()
    url = f"127.0.0.1:{srv.server.triton_port}"
    busy, idle = Streamer(url), Streamer(url)
    try:
        idle.send("ensemble", _ensemble("Hi", 2))
        assert not idle.read().errors  # used once, then left open
        busy.send("ensemble", _ensemble("Hi", 300, return_num_output_tokens=True), "d")
        assert busy.queue.get(timeout=30)[1] is None
        started = time.monotonic()
        drained = threading.Thread(target=srv.run, args=(srv.server.drain_and_stop(10),))
        drained.start()
        rest = busy.read()
        assert not rest.errors and rest.results[-1].get_response().id == "d"  # finished, every token sent
        drained.join(15)
        assert not drained.is_alive() and time.monotonic() - started < 5  # not the 10 s drain timeout
        with pytest.raises(InferenceServerException, match="UNAVAILABLE"):  # the port is closed
            tg.InferenceServerClient(url).is_server_live()
    finally:
        busy.close(cancel=True)
        idle.close(cancel=True)
        srv.stop()


def test_unary_deadline_aborts_in_the_engine(server: ServerThread, url: str) -> None:
    client = tg.InferenceServerClient(url)
    tensors = inputs("ensemble_sync", text_input="Hi", max_tokens=990, end_id=-1)
    with server.paced(min_step_s=0.002), pytest.raises(InferenceServerException) as err:  # 990 tokens take 2 s
        client.infer("ensemble_sync", tensors, client_timeout=0.3)
    assert "DEADLINE_EXCEEDED" in err.value.status()
    assert server.idle()  # the request was aborted at the deadline, not run to its 990 tokens
    assert server.metric("llm_triton_requests_total", 'code="DEADLINE_EXCEEDED",model="ensemble_sync"') == 1


def test_api_docs_name_every_served_tensor() -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    for name in ("ensemble", "tensorrt_llm"):
        spec = MODELS[name]
        missing = [t.name for t in (*spec.served_inputs, *spec.outputs) if t.served and f"`{t.name}`" not in text]
        assert not missing, f"docs/api.md does not describe {name}'s {missing}"
