"""Clients that stop reading, or take more than their share, over real sockets (issue S1).

A Triton stream that never read used to shut every other client out: finished requests kept their RPC slots
while their responses waited on the stream, and one stream could carry more requests than the server had
slots. Now a slot ends with its request's work, one connection holds at most its share of the slots, and a
stream whose client takes no response for --stream-stall-timeout seconds is ended (its requests aborted).

The never-reading client advertises a small HTTP/2 window (as an attacker may), so its responses back up
into the server's stream at once instead of after megabytes of gRPC buffering.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import tritonclient.grpc as tg
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from protos.llm.v1 import llm_pb2, llm_pb2_grpc
from tests.engines import build_tiny
from tests.servers import ServerThread, generate, running_server
from tests.triton_clients import inputs
from tests.waiting import wait_until

pytestmark = pytest.mark.server

OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # gRPC Python shares one per target by default
SMALL_WINDOW = [*OWN_CONNECTION, ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory, "tiny-unread", max_batch_size=16, max_num_tokens=64, max_seq_len=1024)


def _trt_request(i: int, tokens: int) -> service_pb2.ModelInferRequest:
    req = service_pb2.ModelInferRequest(model_name="tensorrt_llm", id=f"r{i}")
    values = {"input_ids": [5, 6, 7], "input_lengths": 3, "request_output_len": tokens, "streaming": True}
    for t in inputs("tensorrt_llm", **values, end_id=-1):
        req.inputs.append(t._get_tensor())
        req.raw_input_contents.append(t._get_content())
    return req


def _never_read_triton(srv: ServerThread, n: int, tokens: int):
    """A ModelStreamInfer call that sends n requests and never reads a response (keep it referenced)."""
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.server.triton_port}", options=SMALL_WINDOW)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    return channel, stub.ModelStreamInfer(iter([_trt_request(i, tokens) for i in range(n)]), timeout=120)


def _served(srv: ServerThread) -> None:
    """Another client, on its own connections, gets Generate, ModelInfer and health answered."""
    req = llm_pb2.GenerateRequest(prompt="hi", stopping=llm_pb2.StoppingParams(max_tokens=5, ignore_eos=True))
    chunks, complete = generate(srv.stub(), req, timeout=30)
    assert complete.usage.completion_tokens == 5 == sum(len(c.token_ids) for c in chunks)
    if srv.server.triton_port is not None:
        client = tg.InferenceServerClient(f"127.0.0.1:{srv.server.triton_port}")
        values = {"input_ids": [5, 6], "input_lengths": 2, "request_output_len": 4}
        result = client.infer("tensorrt_llm_sync", inputs("tensorrt_llm_sync", **values))
        assert result.as_numpy("output_ids").size == 6  # the prompt and 4 new tokens
    health = health_pb2_grpc.HealthStub(srv.channel())
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == SERVING


def test_an_unread_triton_stream_keeps_no_slot_once_its_work_ends(engine_dir: Path) -> None:
    cfg = {"triton_port": 0, "max_concurrent_rpcs": 8, "max_rpcs_per_connection": 4, "stream_stall_timeout_s": 600.0}
    with running_server(engine_dir, **cfg) as srv:
        edge = srv.server.edge
        channel, call = _never_read_triton(srv, 40, 200)
        # its requests beyond its connection's share are refused; the others run to the end, and their
        # responses back up in the stream: the stream's writer waits on the client with no slot held
        wait_until(lambda: edge.num_blocked_writers == 1 and edge.num_active == 0, "its work done, its writer stuck")
        assert srv.metric("llm_rpc_slots_used") == 0
        _served(srv)
        assert edge.num_blocked_writers == 1  # the unread stream is still open
        call.cancel()
        channel.close()
        assert srv.idle()


def test_one_connection_holds_at_most_its_share(engine_dir: Path) -> None:
    cfg = {"max_concurrent_rpcs": 8, "max_rpcs_per_connection": 3}
    with running_server(engine_dir, **cfg) as srv, srv.paced() as paced:
        paced.hold()  # nothing finishes while the slots are counted
        greedy = llm_pb2_grpc.LLMServiceStub(grpc.insecure_channel(srv.target, options=OWN_CONNECTION))
        req = llm_pb2.GenerateRequest(prompt="x", stopping=llm_pb2.StoppingParams(max_tokens=50, ignore_eos=True))
        calls = [greedy.Generate(req) for _ in range(3)]
        wait_until(lambda: srv.server.edge.num_active == 3, "three slots taken")
        with pytest.raises(grpc.RpcError) as err:
            next(greedy.Generate(req))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "per connection" in err.value.details()
        other = srv.stub().Generate(req)  # another connection still gets a slot
        wait_until(lambda: srv.server.edge.num_active == 4, "the other connection's slot")
        paced.release()
        assert sum(len(r.chunk.token_ids) for r in other) == 50
        assert all(sum(len(r.chunk.token_ids) for r in c) == 50 for c in calls)
    assert srv.idle()


def test_a_stalled_triton_stream_is_ended_and_its_requests_aborted(engine_dir: Path) -> None:
    cfg = {"triton_port": 0, "max_rpcs_per_connection": 4, "stream_stall_timeout_s": 1.0}
    with running_server(engine_dir, **cfg) as srv:
        channel, call = _never_read_triton(srv, 4, 900)
        wait_until(lambda: srv.metric("llm_streams_stalled_total") == 1, "the stalled stream ended")
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:  # what was buffered before the server ended the stream, then its status
                pass
        assert err.value.code() == grpc.StatusCode.ABORTED and "--stream-stall-timeout" in err.value.details()
        assert srv.idle()  # requests aborted, every KV block back
        _served(srv)
        channel.close()


def test_a_stalled_generate_stream_is_ended(engine_dir: Path) -> None:
    with running_server(engine_dir, stream_stall_timeout_s=1.0) as srv:
        channel = grpc.insecure_channel(srv.target, options=SMALL_WINDOW)
        req = llm_pb2.GenerateRequest(
            prompt="never read",
            stopping=llm_pb2.StoppingParams(max_tokens=900, ignore_eos=True),
            output=llm_pb2.OutputOptions(logprobs=20),  # ~300 bytes a chunk: far past the client's window
        )
        call = llm_pb2_grpc.LLMServiceStub(channel).Generate(req, timeout=120)
        wait_until(lambda: srv.metric("llm_streams_stalled_total") == 1, "the stalled stream ended")
        wait_until(lambda: srv.server.edge.num_active == 0, "its slot back")
        assert srv.idle()
        _served(srv)
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:  # what was buffered, then the status
                pass
        assert err.value.code() == grpc.StatusCode.ABORTED
        wait_until(lambda: srv.finished("ABORTED") == 1, "counted as ABORTED")
        channel.close()
