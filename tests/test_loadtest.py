"""Load-test client: metric math on hand-computed cases, Triton message mapping, the llama-server backend against a
fake HTTP server, workloads, load drivers."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from clients.loadtest.backends import Sampling, parse_triton_response, triton_inputs
from clients.loadtest.driver import closed_loop, open_loop
from clients.loadtest.llama_server import LlamaServerBackend, SSEDecoder, parse_completion_event
from clients.loadtest.metrics import SLO, RequestRecord, stats, summarize
from clients.loadtest.workload import Lengths, TokenizerFns, WorkItem, from_jsonl, from_sharegpt, synthetic
from tests.fake_llama_server import fake_server


def _rec(send: float, chunks: list[tuple[float, int]], ok: bool = True, input_tokens: int = 10, **kw) -> RequestRecord:
    return RequestRecord(
        input_tokens=input_tokens,
        send_time=send,
        chunk_times=[t for t, _ in chunks],
        chunk_tokens=[n for _, n in chunks],
        ok=ok,
        **kw,
    )


def test_percentiles_use_linear_interpolation() -> None:
    s = stats([float(x) for x in range(1, 11)])  # 1..10
    assert s == pytest.approx({"mean": 5.5, "min": 1.0, "max": 10.0, "p50": 5.5, "p90": 9.1, "p95": 9.55, "p99": 9.91})
    assert stats([]) == dict.fromkeys(("mean", "min", "max", "p50", "p90", "p95", "p99"))
    assert stats([3.0])["p99"] == 3.0


def test_request_metrics_by_hand() -> None:
    r = _rec(10.0, [(10.1, 1), (10.15, 1), (10.3, 2)])  # 4 tokens in 3 chunks
    assert r.output_tokens == 4
    assert r.ttft_ms == pytest.approx(100)
    assert r.e2e_ms == pytest.approx(300)
    assert r.tpot_ms == pytest.approx((300 - 100) / 3)  # (e2e - ttft) / (tokens - 1)
    assert r.itl_ms == pytest.approx([50, 150])  # chunk gaps


def test_tpot_with_one_output_token_is_undefined() -> None:
    r = _rec(0.0, [(0.2, 1)])
    assert r.tpot_ms is None and r.itl_ms == [] and r.ttft_ms == pytest.approx(200) == r.e2e_ms
    summary = summarize([r], 1.0, SLO(tpot_ms=1.0))
    assert summary["tpot_ms"]["mean"] is None
    assert summary["goodput_rps"] == 1.0  # TPOT counts as 0 for the SLO when there is one token


def test_summary_throughputs_and_goodput() -> None:
    records = [
        _rec(0.0, [(0.1, 1), (0.2, 1), (0.3, 1)], input_tokens=5),  # ttft 100, tpot 100
        _rec(0.0, [(0.5, 1), (0.6, 1)], input_tokens=7),  # ttft 500, tpot 100
        _rec(0.0, [(0.05, 1), (0.45, 1)], input_tokens=3),  # ttft 50, tpot 400
        _rec(0.0, [], ok=False, error="RESOURCE_EXHAUSTED: queue full"),
    ]
    s = summarize(records, 2.0, SLO(ttft_ms=200, tpot_ms=200))
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["request_throughput_rps"] == 1.5
    assert s["output_throughput_tok_s"] == 3.5  # 7 tokens / 2 s
    assert s["total_throughput_tok_s"] == 11.0  # (15 + 7) / 2
    assert s["goodput_rps"] == 0.5  # only the first meets both SLOs
    assert s["ttft_ms"]["p50"] == pytest.approx(100)
    assert s["errors"] == ["RESOURCE_EXHAUSTED: queue full"]
    assert SLO.parse(["ttft_ms=200", "tpot_ms=50"]) == SLO(ttft_ms=200, tpot_ms=50)
    with pytest.raises(ValueError):
        SLO.parse(["latency=3"])


def test_server_timers_and_gap() -> None:
    r = _rec(0.0, [(0.1, 1), (0.2, 1)], server_ttft_ms=95.0, server_tpot_ms=99.0)
    s = summarize([r], 1.0, SLO())
    assert s["server_ttft_ms"]["p50"] == 95.0 and s["server_tpot_ms"]["p50"] == 99.0
    assert s["ttft_gap_ms"]["p50"] == pytest.approx(5.0)


# ---- Triton mapping, against tritonclient's own message types ------------------------------------------------
def test_triton_inputs_match_the_ensemble_contract() -> None:
    item = WorkItem("Hello world", None, 2, 64)
    inputs = {i.name(): i for i in triton_inputs(item, Sampling(temperature=0.5, seed=7))}
    assert {n: (i.datatype(), i.shape()) for n, i in inputs.items() if n in ("text_input", "max_tokens", "stream")} == {
        "text_input": ("BYTES", [1, 1]),
        "max_tokens": ("INT32", [1, 1]),
        "stream": ("BOOL", [1, 1]),
    }
    assert inputs["temperature"].datatype() == "FP32" and inputs["seed"].datatype() == "UINT64"
    assert inputs["return_perf_metrics"].datatype() == "BOOL"
    # TensorRT-LLM is greedy unless top_k or top_p is set: sampling sends the full nucleus
    assert np.frombuffer(inputs["top_p"]._get_content(), dtype=np.float32).tolist() == [1.0]
    assert "top_k" not in inputs
    assert np.frombuffer(inputs["end_id"]._get_content(), dtype=np.int32).tolist() == [-1]  # ignore_eos
    greedy = {i.name(): i for i in triton_inputs(item, Sampling(temperature=0.0, ignore_eos=False))}
    assert np.frombuffer(greedy["top_k"]._get_content(), dtype=np.int32).tolist() == [1]
    assert not {"temperature", "top_p", "end_id"} & set(greedy)
    tensor = inputs["max_tokens"]._get_tensor()
    assert tensor.name == "max_tokens" and list(tensor.shape) == [1, 1]
    assert np.frombuffer(inputs["max_tokens"]._get_content(), dtype=np.int32).tolist() == [64]
    assert inputs["text_input"]._get_content()[4:] == b"Hello world"  # 4-byte length prefix, then the bytes
    with pytest.raises(ValueError, match="tokenizer"):
        triton_inputs(WorkItem(None, [1, 2], 2, 8), Sampling())


def _infer_result(text: bytes | None, final: bool, **int_outputs: int):
    from tritonclient.grpc import InferResult, service_pb2
    from tritonclient.utils import serialize_byte_tensor

    resp = service_pb2.ModelInferResponse(model_name="ensemble", id="r1")
    if text is not None:
        resp.outputs.add(name="text_output", datatype="BYTES", shape=[1, 1])
        resp.raw_output_contents.append(serialize_byte_tensor(np.array([text], dtype=np.object_)).item())
    for name, value in int_outputs.items():
        dtype = "INT32" if name == "num_output_tokens" else "INT64"
        resp.outputs.add(name=name, datatype=dtype, shape=[1, 1])
        resp.raw_output_contents.append(np.array([value], dtype=np.int32 if dtype == "INT32" else np.int64).tobytes())
    resp.parameters["triton_final_response"].bool_param = final
    return InferResult(resp)


def test_triton_streamed_responses_are_parsed() -> None:
    first = parse_triton_response(_infer_result(b" Paris", False), 0)
    assert (first.text, first.tokens, first.final) == (" Paris", 1, False)
    counted = parse_triton_response(_infer_result(b" is nice", False, num_output_tokens=2), 1)
    assert counted.tokens == 2  # the tokens of this response, whatever came before
    again = parse_triton_response(_infer_result(b"!", False, num_output_tokens=1), 3)
    assert again.tokens == 1  # not 1 - 3: the count is per response, not a running total
    timed = parse_triton_response(
        _infer_result(
            b".", True, arrival_time_ns=1_000_000, first_token_time_ns=21_000_000, last_token_time_ns=61_000_000
        ),
        4,
    )
    assert timed.final and timed.server_ttft_ms == pytest.approx(20.0)
    assert timed.server_tpot_ms == pytest.approx(40.0 / 4)  # (last - first) / (5 tokens - 1)
    empty_final = parse_triton_response(_infer_result(None, True), 5)
    assert empty_final.final and empty_final.tokens == 0 and empty_final.text == ""


# ---- llama-server, against a fake of its HTTP API -------------------------------------------------------------
@pytest.fixture
def fake_llama_server() -> Iterator[ThreadingHTTPServer]:
    server = fake_server("127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


def _send(url: str, item: WorkItem, sampling: Sampling | None = None) -> RequestRecord:
    rec = RequestRecord(input_tokens=item.input_tokens)
    asyncio.run(LlamaServerBackend(url).send(item, sampling or Sampling(), rec))
    return rec


def test_llama_server_stream_becomes_token_records(fake_llama_server: ThreadingHTTPServer) -> None:
    url = f"http://127.0.0.1:{fake_llama_server.server_port}"
    rec = _send(url, WorkItem(None, [5, 6, 7], 3, 6))
    assert rec.ok and rec.error is None
    assert rec.chunk_tokens == [1, 2, 1, 1, 1] and rec.output_tokens == 6  # the held-back token counted once
    assert len(rec.chunk_times) == 5 and rec.chunk_times == sorted(rec.chunk_times)
    assert 0 < rec.ttft_ms <= rec.e2e_ms and len(rec.itl_ms) == 4 and min(rec.itl_ms) >= 0
    assert rec.tpot_ms == pytest.approx((rec.e2e_ms - rec.ttft_ms) / 5)
    assert (rec.input_tokens, rec.server_ttft_ms, rec.server_tpot_ms) == (3, 12.5, 3.25)  # the final event's
    (body,) = fake_llama_server.bodies
    assert body == {"prompt": [5, 6, 7], "n_predict": 6, "stream": True, "ignore_eos": True, "cache_prompt": False,
                    "temperature": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0}  # fmt: skip
    sampled = _send(url, WorkItem("a text prompt", None, 3, 4), Sampling(temperature=0.7, ignore_eos=False, seed=3))
    assert sampled.ok and sampled.output_tokens == 4
    body = fake_llama_server.bodies[-1]
    assert (body["prompt"], body["top_k"], body["temperature"], body["seed"], body["ignore_eos"]) == (
        "a text prompt", 0, 0.7, 3, False)  # fmt: skip


def test_llama_server_failures_are_recorded(fake_llama_server: ThreadingHTTPServer) -> None:
    url = f"http://127.0.0.1:{fake_llama_server.server_port}"
    refused = _send(url, WorkItem(None, [5], 1, 0))
    assert not refused.ok and refused.error.startswith("HTTP 400: ") and "n_predict" in refused.error
    broken = _send(url, WorkItem("fail", None, 1, 8))
    assert not broken.ok and broken.error == "LLAMA-SERVER: boom" and broken.output_tokens == 1  # counted until then
    gone = _send(f"http://127.0.0.1:{_closed_port()}", WorkItem(None, [5], 1, 4))
    assert not gone.ok and gone.error.startswith("UNAVAILABLE: ")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # bound once, then closed: nothing listens there


def test_llama_server_events_and_sse_framing() -> None:
    sse = SSEDecoder()
    assert sse.feed(b'data: {"a": 1}\r\n\r\n: ping\n\ndata: {"b"') == [{"a": 1}]
    assert sse.feed(b': 2}\n\nerror: {"message": "old style"}\n\n') == [{"b": 2}, {"error": {"message": "old style"}}]
    chunk = parse_completion_event({"content": "", "tokens": [1, 2], "stop": False}, 5)
    assert (chunk.tokens, chunk.final) == (2, False)  # no tokens_predicted: the tokens it carries
    final = parse_completion_event({"stop": True, "tokens_predicted": 1, "stop_type": "eos",
                                    "timings": {"prompt_ms": 4.0, "predicted_n": 1, "predicted_per_token_ms": 0}}, 1)  # fmt: skip
    assert final.final and final.tokens == 0 and final.server_ttft_ms == 4.0 and final.server_tpot_ms is None
    with pytest.raises(ValueError, match="boom"):
        parse_completion_event({"error": {"message": "boom"}}, 0)


def test_llama_server_protocol_sweep(fake_llama_server: ThreadingHTTPServer, tmp_path: Path) -> None:
    """`python -m clients.loadtest --protocol llama-server`: the server's tokenizer, exact lengths, its timings."""
    from clients.loadtest.__main__ import main

    url = f"http://127.0.0.1:{fake_llama_server.server_port}"
    code = main(["--protocol", "llama-server", "--target", url, "--concurrency", "1,3", "--num-requests", "6",
                 "--input-len", "16", "--output-len", "5", "--ignore-eos", "--warmup", "1",
                 "--output", str(tmp_path / "r.json")])  # fmt: skip
    assert code == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["meta"]["model"]["model_name"] == "tiny-Q4_K_M.gguf"
    for run in result["runs"]:
        assert (run["completed"], run["failed"], run["output_tokens"], run["input_tokens"]) == (6, 0, 30, 96)
        assert run["server_ttft_ms"]["p50"] == 12.5 and run["itl_ms"]["p50"] is not None
    assert [len(b["prompt"]) for b in fake_llama_server.bodies] == [16] * 14  # token ids; 2 warm-ups + 12
    assert all(isinstance(t, int) for b in fake_llama_server.bodies for t in b["prompt"])


# ---- workloads ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok(tiny_engine_dir: Path) -> TokenizerFns:
    from service.tokenizer import Tokenizer

    t = Tokenizer.from_engine_dir(tiny_engine_dir)
    return TokenizerFns(t.encode, t.decode)


def test_synthetic_prompts_have_the_asked_length(tok: TokenizerFns) -> None:
    ids_only = TokenizerFns(tok.encode, None)
    items = synthetic(ids_only, 20, Lengths(128, 32), np.random.default_rng(0))
    assert all(len(i.prompt_token_ids) == i.input_tokens == 128 and i.max_tokens == 32 for i in items)
    assert len({tuple(i.prompt_token_ids) for i in items}) == 20  # different windows of the text
    spread = synthetic(ids_only, 50, Lengths(0, 0, (10, 300), (5, 9)), np.random.default_rng(1))
    lens = [i.input_tokens for i in spread]
    assert min(lens) >= 10 and max(lens) <= 300 and len(set(lens)) > 10
    text = synthetic(tok, 5, Lengths(64, 8), np.random.default_rng(2))
    assert all(i.prompt and abs(i.input_tokens - 64) <= 2 for i in text)


def test_jsonl_and_sharegpt_datasets(tok: TokenizerFns, tmp_path: Path) -> None:
    (tmp_path / "p.jsonl").write_text('{"prompt": "one two three"}\n\n{"prompt": "four", "max_tokens": 9}\n')
    items = from_jsonl(tmp_path / "p.jsonl", tok, 16)
    assert [(i.prompt, i.max_tokens) for i in items] == [("one two three", 16), ("four", 9)]
    convs = [
        {
            "conversations": [
                {"from": "human", "value": "What is a harbour?"},
                {"from": "gpt", "value": "A sheltered place for ships."},
            ]
        },
        {"conversations": [{"from": "human", "value": "hi"}]},  # no reply: skipped
    ]
    (tmp_path / "sg.json").write_text(json.dumps(convs))
    sg = from_sharegpt(tmp_path / "sg.json", tok, 4096, 4096)
    assert len(sg) == 1 and sg[0].max_tokens == len(tok.encode("A sheltered place for ships."))


# ---- drivers ------------------------------------------------------------------------------------------------
class FakeBackend:
    """Stands in for a server: each request takes `latency` seconds and returns `tokens` tokens."""

    def __init__(self, latency: float = 0.02, tokens: int = 4) -> None:
        self.latency, self.tokens = latency, tokens
        self.in_flight = self.max_in_flight = 0
        self.sent_at: list[float] = []

    async def send(self, item: WorkItem, sampling: Sampling, rec: RequestRecord) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        rec.send_time = time.perf_counter()
        self.sent_at.append(rec.send_time)
        try:
            for _ in range(self.tokens):
                await asyncio.sleep(self.latency / self.tokens)
                rec.chunk_times.append(time.perf_counter())
                rec.chunk_tokens.append(1)
            rec.ok = True
        except asyncio.CancelledError:
            rec.error = "CANCELLED: stopped at the run's time limit"
            raise
        finally:
            self.in_flight -= 1

    async def close(self) -> None:
        pass


ITEMS = [WorkItem("x", None, 1, 4)] * 40


def test_closed_loop_keeps_the_concurrency() -> None:
    fake = FakeBackend()
    records, duration = asyncio.run(closed_loop(fake, ITEMS, 8, Sampling(), time_limit_s=10))
    assert len(records) == 40 and all(r.ok for r in records)
    assert fake.max_in_flight == 8
    assert duration < 40 * 0.02  # concurrent, not one by one


def test_open_loop_follows_the_rate() -> None:
    fake = FakeBackend(latency=0.01)
    items = [WorkItem("x", None, 1, 4)] * 100
    records, _ = asyncio.run(open_loop(fake, items, 200.0, Sampling(), 10, rng=np.random.default_rng(0)))
    gaps = np.diff(fake.sent_at)
    assert len(records) == 100 and 0.003 < gaps.mean() < 0.008  # Poisson at 200/s: mean gap 5 ms
    bursty = FakeBackend(latency=0.01)
    asyncio.run(open_loop(bursty, items, 200.0, Sampling(), 10, burstiness=0.2, rng=np.random.default_rng(0)))
    assert np.diff(bursty.sent_at).std() > gaps.std()  # gamma shape < 1: burstier arrivals


def test_time_limit_cancels_and_counts_failures() -> None:
    slow = FakeBackend(latency=5.0)
    start = time.perf_counter()
    records, _ = asyncio.run(closed_loop(slow, ITEMS, 4, Sampling(), time_limit_s=0.2))
    assert time.perf_counter() - start < 2
    assert len(records) == 4 and not any(r.ok for r in records)
    assert all(r.error.startswith("CANCELLED") for r in records)
