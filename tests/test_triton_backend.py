"""The chain: service A (native, --triton-port P) and service B (--backend triton --triton-url 127.0.0.1:P), both
real gRPC servers on 127.0.0.1. Generate on B equals Generate on A; B's cancellations free A's KV blocks; B
follows A's health down and back up."""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.llm.v1 import llm_pb2
from service.errors import BackendLoadError
from tests.engines import build_tiny
from tests.servers import ServerThread, free_port, generate, make_config, running_server
from tests.waiting import wait_until

pytestmark = pytest.mark.server

VARIED = {"temperature": 10.0, "seed": 11}  # the tiny model's greedy text repeats one character


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory, "tiny-chain", max_batch_size=16, max_num_tokens=64, max_seq_len=1024)


@pytest.fixture(scope="module")
def a(engine_dir: Path):
    with running_server(engine_dir, triton_port=0) as s:
        yield s


def _b_config(engine_dir: Path, port: int, model: str = "tensorrt_llm", **kw):
    return make_config(
        engine_dir,
        backend_name="triton",
        **{"backend.triton.url": f"127.0.0.1:{port}", "backend.triton.model": model, **kw},
    )


@pytest.fixture(scope="module", params=["tensorrt_llm", "ensemble"])
def b(request, engine_dir: Path, a: ServerThread):
    with running_server(engine_dir, **_b_kw(a, request.param)) as s:
        yield s


def _b_kw(a: ServerThread, model: str) -> dict:
    return {
        "backend_name": "triton",
        "backend.triton.url": f"127.0.0.1:{a.server.triton_port}",
        "backend.triton.model": model,
    }


def _gen(srv: ServerThread, timeout: float = 30, **fields) -> tuple[list[llm_pb2.Chunk], llm_pb2.Complete]:
    fields.setdefault("stopping", llm_pb2.StoppingParams(max_tokens=24, ignore_eos=True))
    return generate(srv.stub(), llm_pb2.GenerateRequest(**fields), timeout=timeout)


REQUESTS = {
    "greedy prompt": {"prompt": "Hello there", "sampling": llm_pb2.SamplingParams(temperature=0)},
    "sampled prompt": {"prompt": "The capital of France is", "sampling": llm_pb2.SamplingParams(**VARIED)},
    "chat": {
        "messages": llm_pb2.ChatMessages(messages=[llm_pb2.ChatMessage(role="user", content="Write a haiku")]),
        "sampling": llm_pb2.SamplingParams(top_k=20, top_p=0.9, **VARIED),
    },
    "penalties": {
        "prompt": "1, 2, 3, 4,",
        "sampling": llm_pb2.SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
                                           **VARIED),
        "stopping": llm_pb2.StoppingParams(max_tokens=30, min_tokens=5, ignore_eos=True),
    },
}  # fmt: skip


def test_generate_on_b_equals_generate_on_a(a: ServerThread, b: ServerThread) -> None:
    tokens = b.server.backend.model == "tensorrt_llm"
    for name, fields in REQUESTS.items():
        chunks_a, done_a = _gen(a, **fields)
        chunks_b, done_b = _gen(b, **fields)
        text_a, text_b = "".join(c.text for c in chunks_a), "".join(c.text for c in chunks_b)
        assert text_b == text_a and len(set(text_a)) >= (1 if name == "greedy prompt" else 5), name
        if tokens:  # token-level parity: the same ids in the chunks
            assert [t for c in chunks_b for t in c.token_ids] == [t for c in chunks_a for t in c.token_ids], name
        else:  # the ensemble returns text and counts only
            assert not any(c.token_ids for c in chunks_b)
        assert done_b.usage.completion_tokens == done_a.usage.completion_tokens, name
        assert done_b.usage.prompt_tokens == done_a.usage.prompt_tokens, name
        assert done_b.finish_reason == done_a.finish_reason == llm_pb2.FINISH_REASON_LENGTH, name
        assert done_b.timing.source == llm_pb2.TIMING_SOURCE_ENGINE  # A's times, through *_time_ns
        assert 0 < done_b.timing.ttft_ms <= done_b.timing.e2e_ms
    assert a.idle() and b.idle()


def test_stops_are_the_same_on_b(a: ServerThread, b: ServerThread) -> None:
    full, _ = _gen(a, prompt="Hello there", sampling=llm_pb2.SamplingParams(**VARIED))
    text = "".join(c.text for c in full)
    stop = text[8:11]
    fields = {
        "prompt": "Hello there",
        "sampling": llm_pb2.SamplingParams(**VARIED),
        "stopping": llm_pb2.StoppingParams(max_tokens=24, ignore_eos=True, stop=[stop]),
    }
    chunks_a, done_a = _gen(a, **fields)
    chunks_b, done_b = _gen(b, **fields)
    assert "".join(c.text for c in chunks_b) == "".join(c.text for c in chunks_a) == text[: text.index(stop)]
    assert done_b.stop_string == done_a.stop_string == stop
    assert done_b.finish_reason == llm_pb2.FINISH_REASON_STOP
    if b.server.backend.model == "tensorrt_llm":
        ids = [t for c in full for t in c.token_ids]
        by_id = {**fields, "stopping": llm_pb2.StoppingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[ids[5]])}
        chunks_a, done_a = _gen(a, **by_id)
        chunks_b, done_b = _gen(b, **by_id)
        assert [t for c in chunks_b for t in c.token_ids] == [t for c in chunks_a for t in c.token_ids]
        assert done_b.stop_token_id == done_a.stop_token_id == ids[5]
    assert a.idle() and b.idle()


def test_b_reports_what_it_cannot_do(b: ServerThread) -> None:
    info = b.stub().GetModelInfo(llm_pb2.GetModelInfoRequest())
    assert info.backend == "triton" and "logprobs" in info.not_reported
    with pytest.raises(grpc.RpcError) as err:
        _gen(b, prompt="Hi", output=llm_pb2.OutputOptions(logprobs=0))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprobs" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # Triton's models have no cache salt input: no salt is kept apart
        _gen(b, prompt="Hi", cache_salt="tenant-a")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("cache_salt: ")
    if b.server.backend.model == "ensemble":
        assert "chunk.token_ids" in info.not_reported
        # 'h', 'e' as two ids: the ensemble's preprocessing would tokenize their text as one ('he')
        he = b.server.backend.tokenizer.encode("h") + b.server.backend.tokenizer.encode("e")
        with pytest.raises(grpc.RpcError) as err:
            _gen(b, prompt_token_ids=llm_pb2.TokenIds(ids=he))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "re-encoding" in err.value.details()
    else:
        assert info.not_reported == ["logprobs", "cached_prompt_tokens"]


def test_cancelling_on_b_frees_the_kv_blocks_of_a(a: ServerThread, b: ServerThread) -> None:
    req = llm_pb2.GenerateRequest(
        prompt="Once upon a time", stopping=llm_pb2.StoppingParams(max_tokens=990, ignore_eos=True)
    )
    calls = [b.stub().Generate(req, timeout=60) for _ in range(12)]
    for call in calls:
        next(call)  # each has streamed output: it holds blocks on A
    assert a.server.backend.core.kv.pool.num_used_blocks > 0 and a.server.backend.num_in_flight == 12
    for call in calls:
        call.cancel()
    assert b.idle() and a.idle()  # cancelled through to A's engine: every block back within seconds


def test_no_thread_is_left_behind(a: ServerThread, b: ServerThread) -> None:
    """Every request's stream is closed for good (tritonclient's cancel alone leaks gRPC's sending thread)."""
    _gen(b, prompt="warm up")  # the backend's small pools exist from here
    before = threading.active_count()

    def one(i: int) -> None:
        req = llm_pb2.GenerateRequest(prompt=f"Hi {i}", stopping=llm_pb2.StoppingParams(max_tokens=40, ignore_eos=True))
        call = b.stub().Generate(req, timeout=60)
        for n, _ in enumerate(call):
            if i % 2 and n == 1:
                call.cancel()
                return

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(40)))
    assert b.idle() and a.idle()
    wait_until(lambda: threading.active_count() <= before + 4, "threads back")  # not one per request (40)


def _health(srv: ServerThread) -> int:
    stub = health_pb2_grpc.HealthStub(srv.channel())
    try:
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
    except grpc.RpcError:
        return -1


def _wait_health(srv: ServerThread, status: int) -> None:
    wait_until(lambda: _health(srv) == status, f"health {status}")


def test_b_follows_a_down_and_back_up(engine_dir: Path) -> None:
    port = free_port()
    a = ServerThread(make_config(engine_dir, triton_port=port)).start()
    b = ServerThread(_b_config(engine_dir, port)).start()
    try:
        assert _health(b) == health_pb2.HealthCheckResponse.SERVING
        a.stop()
        _wait_health(b, health_pb2.HealthCheckResponse.NOT_SERVING)
        with pytest.raises(grpc.RpcError) as err:
            _gen(b, prompt="Hi")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and f"127.0.0.1:{port}" in err.value.details()
        a = ServerThread(make_config(engine_dir, triton_port=port)).start()
        _wait_health(b, health_pb2.HealthCheckResponse.SERVING)
        chunks, done = _gen(b, prompt="Hi")
        assert done.usage.completion_tokens == 24 == sum(len(c.token_ids) for c in chunks)
    finally:
        b.stop()
        a.stop()


def test_streams_in_flight_fail_cleanly_when_a_dies(engine_dir: Path) -> None:
    port = free_port()
    a = ServerThread(make_config(engine_dir, triton_port=port)).start()
    b = ServerThread(_b_config(engine_dir, port)).start()
    try:
        req = llm_pb2.GenerateRequest(prompt="Hi", stopping=llm_pb2.StoppingParams(max_tokens=990, ignore_eos=True))
        with a.paced(min_step_s=0.005):  # 990 tokens take at least 5 s: all four still run when A stops
            calls = [b.stub().Generate(req, timeout=60) for _ in range(4)]
            for call in calls:
                next(call)
            with ThreadPoolExecutor(1) as pool:
                pool.submit(a.stop).result(30)
        codes = set()
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                list(call)
            codes.add(err.value.code())
        assert codes <= {grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED}  # they had streamed tokens
        assert b.idle()
    finally:
        b.stop()
        a.stop()


def test_b_does_not_start_without_a_triton_server(engine_dir: Path) -> None:
    srv = ServerThread(_b_config(engine_dir, free_port(), **{"backend.triton.ready_timeout_s": 0.5}))
    with pytest.raises(BackendLoadError, match=r"is not ready with model 'tensorrt_llm' after 0\.5 s"):
        srv.start()
    srv.stop()


def test_cli_refuses_without_a_reachable_triton_server(engine_dir: Path) -> None:
    base = [sys.executable, "-m", "service", "--engine", str(engine_dir), "--backend", "triton", "--port", "0",
            "--metrics-port", "-1"]  # fmt: skip
    missing = subprocess.run(base, capture_output=True, text=True, timeout=60, check=False)
    assert missing.returncode == 2 and "needs --triton-url HOST:PORT" in missing.stderr
    assert "listening" not in missing.stderr  # refused before any port was bound
    port = free_port()
    down = subprocess.run(
        [*base, "--triton-url", f"127.0.0.1:{port}", "--triton-ready-timeout", "0.5"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert down.returncode == 2 and f"the Triton server at 127.0.0.1:{port} is not ready" in down.stderr


def test_the_worker_door_on_b(a: ServerThread, b: ServerThread) -> None:
    """trtllm.TrtllmService on a triton-backed server: Generate gives A's greedy ids over the tensorrt_llm model;
    over the ensemble (text only, and the worker protocol streams ids) every RPC, HealthCheck too, is
    UNIMPLEMENTED, so a gateway never registers it. No KV events either way."""
    from smg_grpc_proto import trtllm_service_pb2 as pb
    from smg_grpc_proto import trtllm_service_pb2_grpc as pb_grpc
    from smg_grpc_proto.generated import common_pb2

    prompt = list(a.stub().Tokenize(llm_pb2.TokenizeRequest(text="Hello there")).token_ids)
    req = pb.GenerateRequest(
        request_id="b-worker", tokenized=pb.TokenizedInput(input_token_ids=prompt), max_tokens=12, ignore_eos=True
    )
    req.sampling_config.temperature = 0
    stub = pb_grpc.TrtllmServiceStub(b.channel())
    if b.server.backend.model == "tensorrt_llm":
        *_, last = stub.Generate(req)
        greedy = llm_pb2.SamplingParams(temperature=0)
        stopping = llm_pb2.StoppingParams(max_tokens=12, ignore_eos=True)
        chunks, _ = _gen(a, prompt_token_ids=llm_pb2.TokenIds(ids=prompt), sampling=greedy, stopping=stopping)
        ids = [t for c in chunks for t in c.token_ids]
        assert list(last.complete.output_token_ids) == ids and len(ids) == 12
        assert stub.GetServerInfo(pb.GetServerInfoRequest()).backend == "triton"
        with pytest.raises(grpc.RpcError) as err:
            list(stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest()))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    else:
        for call in (lambda: list(stub.Generate(req)), lambda: stub.HealthCheck(pb.HealthCheckRequest())):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED and "tensorrt_llm" in err.value.details()
    assert a.idle() and b.idle()
