"""`python -m clients.loadtest --protocol openai` against the real smg binary (Shepherd Model Gateway 1.13.0) in
front of this server's worker protocol, over TLS with an API key (one smg launch for the module): completions and
chat sweeps at concurrency 2 with ignore_eos give exactly max_tokens per request; a request without the key, or
with a CA that did not sign smg's certificate, fails and says why; a run's time limit cancels its requests and
smg aborts them on the worker. The SSE parsing is unit-tested on canned bytes. Skipped where smg cannot run."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from clients.loadtest.__main__ import main
from clients.loadtest.backends import Sampling
from clients.loadtest.driver import closed_loop
from clients.loadtest.http import SSEDecoder, endpoint, post_json, tls_context
from clients.loadtest.metrics import RequestRecord
from clients.loadtest.openai_http import OpenAIBackend, parse_event, request_body, settle_usage
from clients.loadtest.workload import Lengths, TokenizerFns, WorkItem, synthetic
from tests.servers import ServerThread, running_server
from tests.test_service_security import _ca, _leaf
from tests.test_smg_gateway import _bundle, _smg
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.server]

KEY = "s3cret-key"
MAX_TOKENS = 12


# ---- the SSE stream of an OpenAI API, on canned bytes ------------------------------------------------------------
def test_sse_events_split_across_reads_end_at_done() -> None:
    stream = (
        b'data: {"choices": [{"index": 0, "text": " Paris", "finish_reason": null}]}\r\n\r\n'
        b": keep-alive comment\n\n"
        b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}\n\n'
        b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}\n\n'
        b"data: [DONE]\n\n"
        b'data: {"after": "done"}\n\n'
    )
    sse, events = SSEDecoder(), []
    for i in range(len(stream)):  # one byte per read: every boundary falls inside a read somewhere
        events += sse.feed(stream[i : i + 1])
    assert sse.done and len(events) == 3  # nothing after [DONE]
    chunks = [parse_event(e, "completions") for e in events]
    assert [(c.text, c.finished) for c in chunks] == [(" Paris", False), ("", True), ("", False)]
    assert chunks[2].usage == {"prompt_tokens": 7, "completion_tokens": 3}


def test_chat_deltas_and_error_events() -> None:
    role = parse_event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, "chat")
    assert role.text == "" and not role.finished  # the role-only first event is no token: not TTFT
    text = parse_event({"choices": [{"delta": {"content": "Hi"}, "finish_reason": None}]}, "chat")
    assert text.text == "Hi"
    sse = SSEDecoder()
    (event,) = sse.feed(b'data: {"error": {"message": "worker gone", "type": "internal_error"}}\n\n')
    with pytest.raises(ValueError, match="worker gone"):
        parse_event(event, "chat")
    with pytest.raises(ValueError, match="plain"):
        parse_event({"error": "plain"}, "completions")


def test_usage_settles_the_totals() -> None:
    rec = RequestRecord(input_tokens=5, send_time=1.0, chunk_times=[1.1, 1.2, 1.3], chunk_tokens=[1, 1, 1])
    settle_usage(rec, {"prompt_tokens": 31, "completion_tokens": 5})  # 2 tokens streamed no text
    assert (rec.input_tokens, rec.output_tokens, rec.chunk_tokens) == (31, 5, [1, 1, 3])
    assert rec.ttft_ms == pytest.approx(100) and rec.tpot_ms == pytest.approx(200 / 4)
    settle_usage(rec, None)  # a server that sends no usage: the chunks' count stands
    assert rec.output_tokens == 5


def test_request_bodies() -> None:
    item = WorkItem("Once upon", None, 2, 7)
    assert request_body("completions", "m", item, Sampling(temperature=0.5, ignore_eos=True, seed=3)) == {
        "model": "m", "prompt": "Once upon", "max_tokens": 7, "temperature": 0.5, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True, "seed": 3,
    }  # fmt: skip
    chat = request_body("chat", "m", item, Sampling(temperature=0.0, ignore_eos=False))
    assert chat["messages"] == [{"role": "user", "content": "Once upon"}] and "ignore_eos" not in chat
    with pytest.raises(ValueError, match="--tokenizer"):
        request_body("chat", "m", WorkItem(None, [1, 2], 2, 7), Sampling())


# ---- through smg, over TLS with an API key ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def worker(smollm2_engine_dir: Path) -> Iterator[ServerThread]:
    with running_server(smollm2_engine_dir) as srv:
        yield srv


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "rogue-ca")
    _leaf(d, "server", "ca", "DNS:localhost,IP:127.0.0.1")
    (d / "key.txt").write_text(KEY + "\n")
    return d


@pytest.fixture(scope="module")
def gateway(worker: ServerThread, pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """smg's https:// URL; it wants `authorization: Bearer KEY`."""
    run = tmp_path_factory.mktemp("smg")
    model = worker.server.backend.info.model_name
    _bundle(worker, run / model)
    tls = ["--tls-cert-path", str(pki / "server.crt"), "--tls-key-path", str(pki / "server.key")]
    with _smg(worker.target, model, run, "--api-key", KEY, *tls) as (plain, proc):
        url = plain.replace("http://", "https://")
        ctx = tls_context(str(pki / "ca.crt"))

        def routing() -> bool:
            if proc.poll() is not None:
                pytest.skip(f"smg exited with {proc.returncode}: {(run / 'smg.log').read_text()[-500:]}")
            try:
                body = {"model": model, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
                return bool(post_json(url + "/v1/completions", body, 10, {"authorization": f"Bearer {KEY}"}, ctx))
            except OSError:
                return False

        wait_until(routing, "smg routing to the worker over TLS", within=60)
        yield url


def _argv(gateway: str, pki: Path, engine: Path, *extra: str) -> list[str]:
    return ["--protocol", "openai", "--target", gateway, "--tls-ca", str(pki / "ca.crt"), "--tokenizer", str(engine),
            "--concurrency", "2", "--num-requests", "4", "--warmup", "1", "--input-len", "24",
            "--output-len", str(MAX_TOKENS), "--ignore-eos", *extra]  # fmt: skip


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_sweep_through_smg(
    worker: ServerThread, gateway: str, pki: Path, smollm2_engine_dir: Path, tmp_path: Path, api: str
) -> None:
    out = tmp_path / "r.json"
    argv = _argv(gateway, pki, smollm2_engine_dir, "--openai-api", api, "--auth-token-file", str(pki / "key.txt"))
    assert main([*argv, "--output", str(out), "--csv", str(tmp_path / "r.csv")]) == 0
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert (run["concurrency"], run["completed"], run["failed"], run["errors"]) == (2, 4, 0, [])
    assert run["output_tokens"] == 4 * MAX_TOKENS  # max_tokens caps each: the sum says each has exactly that
    assert 0 < run["ttft_ms"]["min"] and run["ttft_ms"]["max"] <= run["e2e_ms"]["max"]
    assert run["tpot_ms"]["p50"] > 0 and run["itl_ms"]["p50"] > 0
    assert run["input_tokens"] >= 4 * 24  # the server's count (chat: with the template's tokens)
    meta = result["meta"]
    assert (meta["protocol"], meta["openai_api"], meta["target"]) == ("openai", api, gateway)
    assert meta["model"]["model_name"] == worker.server.backend.info.model_name  # the first of GET /v1/models
    assert worker.idle()


def _records(gateway: str, pki: Path, engine: Path, n: int, api: str, time_limit: float = 120.0, **kw):
    tok = Tokenizer.from_file(str(engine / "tokenizer.json"))
    fns = TokenizerFns(lambda s: tok.encode(s).ids, tok.decode)
    items = synthetic(fns, n, Lengths(16, kw.pop("max_tokens", MAX_TOKENS)), np.random.default_rng(1))
    ep = endpoint(gateway, "test", tls_context(str(pki / f"{kw.pop('ca', 'ca')}.crt")))
    backend = OpenAIBackend(ep, "smollm2-135m", api, kw.pop("headers", {"authorization": f"Bearer {KEY}"}))
    records, _ = asyncio.run(closed_loop(backend, items, 2, Sampling(ignore_eos=True), time_limit))
    return records


def test_each_record_has_max_tokens_and_ordered_times(gateway: str, pki: Path, smollm2_engine_dir: Path) -> None:
    for rec in _records(gateway, pki, smollm2_engine_dir, 2, "chat"):
        assert rec.ok and rec.error is None and rec.output_tokens == MAX_TOKENS
        assert 0 < rec.ttft_ms <= rec.e2e_ms and rec.chunk_times == sorted(rec.chunk_times)
        assert len(rec.itl_ms) == len(rec.chunk_times) - 1 and rec.tpot_ms > 0


def test_without_the_key_requests_fail_with_401(
    worker: ServerThread, gateway: str, pki: Path, smollm2_engine_dir: Path, tmp_path: Path
) -> None:
    """smg 1.13.0 lists its models without the key (GET /v1/models), and refuses every completion."""
    out = tmp_path / "r.json"
    assert main([*_argv(gateway, pki, smollm2_engine_dir), "--output", str(out)]) == 1  # no request completed
    (run,) = json.loads(out.read_text())["runs"]
    assert (run["completed"], run["failed"]) == (0, 4)
    assert run["errors"] and all(e.startswith("HTTP 401") for e in run["errors"]), run["errors"]
    assert worker.idle()


def test_a_certificate_the_ca_did_not_sign_is_refused(gateway: str, pki: Path, smollm2_engine_dir: Path) -> None:
    records = _records(gateway, pki, smollm2_engine_dir, 2, "completions", ca="rogue-ca")
    assert all(not r.ok and "CERTIFICATE_VERIFY_FAILED" in r.error for r in records), [r.error for r in records]


def test_the_time_limit_cancels_and_smg_aborts_on_the_worker(
    worker: ServerThread, gateway: str, pki: Path, smollm2_engine_dir: Path
) -> None:
    """1000 tokens at a 50 ms floor per step take over 50 s: a 3 s limit cancels both requests mid-stream; the
    closed connections make smg abort them, so the worker is idle long before they could have finished."""
    with worker.paced(min_step_s=0.05):
        records = _records(gateway, pki, smollm2_engine_dir, 2, "completions", time_limit=3.0, max_tokens=1000)
        assert [r.error for r in records] == ["CANCELLED: stopped at the run's time limit"] * 2
        assert not any(r.ok for r in records)
        assert worker.idle(within=20), "cancelled requests left work on the worker"
