"""Regression tests for the reliability defects (each over a real socket on 127.0.0.1).

1. An out-of-vocabulary stop token id used to kill the engine for good.
2. A reused client request_id used to receive another request's output.
3. Tokenization and chat rendering used to block the event loop (health included).
4. Health used to count against --max-concurrent-rpcs.
5. A second server used to start on a busy port (SO_REUSEPORT).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.llm.v1 import llm_pb2
from tests.engines import build_tiny
from tests.servers import ServerThread, generate, ids_and_text, make_config, running_server
from tests.waiting import wait_until, wait_until_async

pytestmark = pytest.mark.server

VOCAB = 267
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory, "tiny-reliability", max_batch_size=16, max_num_tokens=64, max_seq_len=1024)


@pytest.fixture(scope="module")
def server(engine_dir: Path):
    with running_server(engine_dir) as s:
        yield s


def _req(prompt: str = "Hello there", max_tokens: int = 16, **kw) -> llm_pb2.GenerateRequest:
    return llm_pb2.GenerateRequest(
        prompt=prompt,
        sampling=llm_pb2.SamplingParams(temperature=0),
        stopping=llm_pb2.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
        **kw,
    )


def _tokens(stub, req, **kw) -> tuple[list[int], llm_pb2.Complete]:
    chunks, complete = generate(stub, req, **kw)
    return ids_and_text(chunks)[0], complete


def _health(server: ServerThread, timeout: float = 2.0) -> int:
    stub = health_pb2_grpc.HealthStub(server.channel())
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout).status


def _wait_idle(server: ServerThread, within: float = 3.0) -> None:
    assert server.idle(within), "requests or KV blocks left behind"


# ---- 1. token ids are checked against the vocabulary; the engine survives ------------------------------------


@pytest.mark.parametrize(
    ("field", "build"),
    [
        ("stopping.stop_token_ids", lambda r: (r.stopping.stop_token_ids.append(VOCAB + 5), None)[1]),
        ("prompt_token_ids.ids", lambda r: r.prompt_token_ids.ids.extend([3, VOCAB])),
    ],
)
def test_out_of_vocabulary_token_ids_are_refused(server: ServerThread, field: str, build) -> None:
    req = _req(max_tokens=8)
    req.stopping.min_tokens = 4  # the sampler used to index the logits with the stop ids while min_tokens held
    build(req)
    with pytest.raises(grpc.RpcError) as err:
        list(server.stub().Generate(req))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details() and str(VOCAB) in err.value.details()
    ids, complete = _tokens(server.stub(), _req(max_tokens=8))  # the engine is still alive and serving
    assert len(ids) == 8 and complete.finish_reason == llm_pb2.FINISH_REASON_LENGTH
    assert _health(server) == SERVING
    _wait_idle(server)


# ---- 2. a client's request_id is only echoed ---------------------------------------------------------------------


def test_reused_request_id_gets_its_own_output(server: ServerThread) -> None:
    stub = server.stub()
    expected, _ = _tokens(stub, _req(prompt="the second request", max_tokens=12))
    for round_ in range(30):
        a = stub.Generate(_req(prompt="the first request", max_tokens=600, request_id="shared-id"))
        next(a)  # A is decoding
        a.cancel()
        ids, complete = _tokens(stub, _req(prompt="the second request", max_tokens=12, request_id="shared-id"))
        assert ids == expected, f"round {round_}: B received someone else's tokens"
        assert complete.request_id == "shared-id" and complete.usage.completion_tokens == 12
    _wait_idle(server)  # every A was aborted: nothing keeps running to its max_tokens


def test_same_request_id_twice_at_once(server: ServerThread) -> None:
    stub = server.stub()
    prompts = [f"concurrent prompt {i}" for i in range(6)]
    expected = [_tokens(stub, _req(prompt=p, max_tokens=10))[0] for p in prompts]
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda p: _tokens(stub, _req(prompt=p, max_tokens=10, request_id="dup"))[0], prompts))
    assert got == expected
    _wait_idle(server)


# ---- 3. tokenization is bounded and runs off the event loop ------------------------------------------------------


def test_oversized_chat_is_refused_by_size_before_tokenizing(server: ServerThread) -> None:
    big = "x" * 3584
    messages = llm_pb2.ChatMessages(messages=[llm_pb2.ChatMessage(role="user", content=big)] * 1024)
    start = time.perf_counter()
    with pytest.raises(grpc.RpcError) as err:
        list(server.stub().Generate(llm_pb2.GenerateRequest(messages=messages)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "messages" in err.value.details()
    assert time.perf_counter() - start < 2.0  # tokenizing 3.5 MB would take seconds: it was refused by its size
    with pytest.raises(grpc.RpcError) as err:
        server.stub().Tokenize(llm_pb2.TokenizeRequest(text="y" * 3_000_000))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "text" in err.value.details()


def test_a_message_over_the_byte_limit_is_refused_naming_the_flag(server: ServerThread) -> None:
    """Over --max-message-bytes: our handler refuses it (naming its size and the flag); far over, gRPC core does."""
    limit = server.server.cfg.max_message_bytes
    for size, says in ((limit + 1024, "--max-message-bytes"), (2 * limit + 2**20 + 1024, "larger than max")):
        with pytest.raises(grpc.RpcError) as err:
            list(server.stub().Generate(llm_pb2.GenerateRequest(prompt="x" * size)))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and says in err.value.details()
    assert _tokens(server.stub(), _req())[1].usage.completion_tokens == 16  # and the server serves on


def test_slow_tokenization_does_not_block_health(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = server.server.backend.core.tokenizer
    real = tokenizer.encode
    entered, release = threading.Event(), threading.Event()

    def stuck_encode(text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        entered.set()
        release.wait(30)  # holds the calling thread, as a huge prompt would, until the test has looked
        return real(text, add_special_tokens, max_tokens)

    monkeypatch.setattr(tokenizer, "encode", stuck_encode)
    stub = server.stub()
    done = threading.Event()
    threading.Thread(target=lambda: (_tokens(stub, _req(max_tokens=2)), done.set()), daemon=True).start()
    try:
        assert entered.wait(30)  # the Generate is tokenizing now
        for _ in range(5):
            assert _health(server) == SERVING  # answered while the tokenizer holds its thread
        assert not done.is_set()
    finally:
        release.set()
    assert done.wait(30)


# ---- 4. the RPC limit applies to LLM calls only ------------------------------------------------------------------


def test_health_answers_when_the_rpc_limit_is_taken(engine_dir: Path) -> None:
    with running_server(engine_dir, max_concurrent_rpcs=2, max_rpcs_per_connection=2) as srv, srv.paced() as paced:
        stub = srv.stub()
        streams = [stub.Generate(_req(prompt=f"long {i}", max_tokens=900)) for i in range(2)]
        for s in streams:
            next(s)
        paced.hold()  # both keep their slots for as long as the test looks
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(_req(max_tokens=2)))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as err:
            stub.Tokenize(llm_pb2.TokenizeRequest(text="x"))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for _ in range(5):
            assert _health(srv) == SERVING
        for s in streams:
            s.cancel()
        paced.release()
        _wait_idle(srv)
        assert len(_tokens(stub, _req(max_tokens=3))[0]) == 3  # the slots came back


# ---- 5. one port, one server ---------------------------------------------------------------------------------------


def test_a_busy_port_is_refused(engine_dir: Path) -> None:
    with running_server(engine_dir) as first:
        second = ServerThread(make_config(engine_dir, port=first.server.port))
        with pytest.raises(OSError, match=f"gRPC port {first.server.port} .*--port / LLM_PORT"):
            second.start()
        second.stop()
        with socket.socket() as s:  # a busy metrics port is reported before the gRPC port is bound
            s.bind(("127.0.0.1", 0))
            s.listen()
            busy = s.getsockname()[1]
            third = ServerThread(make_config(engine_dir, metrics_port=busy))
            with pytest.raises(OSError, match=f"metrics port {busy} .*--metrics-port / LLM_METRICS_PORT"):
                third.start()
            third.stop()
        assert _health(first) == SERVING


# ---- 6. final status codes: deadlines, and streams cut by the drain timeout ----------------------------------------


def test_deadlines_are_counted_as_deadline_exceeded(server: ServerThread) -> None:
    stub = server.stub()
    before = {c: server.finished(c) for c in ("CANCELLED", "DEADLINE_EXCEEDED")}

    def one(i: int) -> grpc.StatusCode:
        try:
            _tokens(stub, _req(prompt=f"deadline {i}", max_tokens=900), timeout=0.3)
        except grpc.RpcError as err:
            return err.code()
        return grpc.StatusCode.OK

    with server.paced() as paced, ThreadPoolExecutor(8) as pool:
        paced.hold()  # no request can finish before its deadline, however fast the engine
        codes = list(pool.map(one, range(16)))
    assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * 16
    wait_until(
        lambda: server.finished("DEADLINE_EXCEEDED") - before["DEADLINE_EXCEEDED"] >= 16,
        "deadlines counted as DEADLINE_EXCEEDED",
    )
    assert server.finished("DEADLINE_EXCEEDED") - before["DEADLINE_EXCEEDED"] == 16
    assert server.finished("CANCELLED") == before["CANCELLED"]
    _wait_idle(server)


def test_drain_timeout_cuts_streams_with_aborted_or_unavailable(engine_dir: Path) -> None:
    srv = ServerThread(make_config(engine_dir, max_num_seqs=1)).start()
    try:
        with srv.paced() as paced, ThreadPoolExecutor(1) as pool:
            stub = srv.stub()
            running = stub.Generate(_req(prompt="running", max_tokens=900))
            next(running)  # decoding: it holds the only sequence slot
            paced.hold()  # and it cannot finish before the drain timeout, on any machine
            queued = pool.submit(lambda: _tokens(stub, _req(prompt="queued", max_tokens=10)))
            wait_until(lambda: srv.server.backend.num_in_flight == 2, "the second request admitted")
            drain = asyncio.run_coroutine_threadsafe(srv.server.drain_and_stop(0.3), srv.loop)
            wait_until(lambda: srv.server.edge.cut, "the drain timeout")
            paced.release()  # the engine applies the aborts
            drain.result(timeout=30)
            with pytest.raises(grpc.RpcError) as err:
                list(running)
            assert err.value.code() == grpc.StatusCode.ABORTED and "after" in err.value.details()
            with pytest.raises(grpc.RpcError) as err:
                queued.result(timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shut down" in err.value.details()
    finally:
        srv.stop()


def test_an_rpc_that_reached_the_server_as_the_drain_began_is_served(engine_dir: Path) -> None:
    """A drain's first act is the gRPC server's stop (listener closed, GOAWAY: gRPC then refuses new streams
    itself, which a proxy retries on another replica). An RPC already on the wire when the drain began, the
    transport accepted: it is served, not refused. A proxy relays an UNAVAILABLE to its client instead of retrying
    (compose e2e behind nginx, least_conn: 14 of 20 requests failed while the handlers refused first, 2 of 20 once
    the transport stopped first but the handlers still refused what had arrived)."""
    srv = ServerThread(make_config(engine_dir)).start()
    try:
        stub = srv.stub()
        _tokens(stub, _req(max_tokens=1))  # the connection is up: the next RPC travels on it, as a proxy's does
        grpc_server = srv.server._server
        real_stop = grpc_server.stop
        seen: dict = {}

        with ThreadPoolExecutor(1) as pool:

            async def stop(grace):  # the drain's first step; an RPC arrives on the kept-alive connection right now
                seen["draining_at_stop"] = srv.server.edge.draining
                seen["rpc"] = rpc = pool.submit(_tokens, stub, _req(prompt="on the wire", max_tokens=8))
                # the drain goes on meanwhile (draining set, health NOT_SERVING): the transport stops once the RPC's
                # handler has taken a slot (or the RPC has ended: refused)
                await wait_until_async(lambda: srv.server.edge.num_active or rpc.done(), "the RPC taken or refused")
                seen["draining_at_arrival"] = srv.server.edge.draining
                return await real_stop(grace)

            grpc_server.stop = stop
            srv.run(srv.server.drain_and_stop(30))
            ids, complete = seen["rpc"].result(timeout=30)  # served: no UNAVAILABLE
        assert seen["draining_at_stop"] is False  # the transport stops before anything else in the drain
        assert seen["draining_at_arrival"] is True  # the RPC reached its handler with the drain under way
        assert len(ids) == 8 and complete is not None
    finally:
        srv.stop()


def test_stream_client_prints_one_clean_error_when_the_server_goes_away(engine_dir: Path) -> None:
    import subprocess
    import sys

    srv = ServerThread(make_config(engine_dir)).start()
    try:
        cmd = [sys.executable, "-m", "clients.stream", "--target", srv.target, "Hi", "--max-tokens", "900",
               "--ignore-eos"]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while not proc.stdout.read(1):  # streaming
            pass
        srv.run(srv.server._server.stop(0))  # gone at once: clients get GOAWAY "Cancelling all calls"
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 1
        assert [line for line in err.splitlines() if line.strip()] == ["error: UNAVAILABLE: Cancelling all calls"]
    finally:
        srv.stop()


def test_ctrl_c_of_the_stream_client_prints_no_traceback(engine_dir: Path) -> None:
    import signal
    import subprocess
    import sys

    with running_server(engine_dir) as srv, srv.paced() as paced:
        cmd = [sys.executable, "-m", "clients.stream", "--target", srv.target, "Hi", "--max-tokens", "900",
               "--ignore-eos"]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while not proc.stdout.read(1):  # streaming
            pass
        paced.hold()  # still streaming when the signal comes
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 130 and "Traceback" not in err and err.strip() == "interrupted", err
        paced.release()
        _wait_idle(srv)  # the cancelled call's request was aborted
