"""Tokenization that never stops the world (issue S2), unit level and over a real socket.

Tokenizer.encode used to hold the GIL for the whole call (seconds for the largest accepted prompt): the event
loop, health checks and the engine thread all stopped. Now it releases it, a prompt that cannot fit is
refused after tokenizing about as much of it as could fit, text being tokenized is bounded per server and
per connection, and a Tokenize reply over the message limit is refused by its size.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from protos.llm.v1 import llm_pb2, llm_pb2_grpc
from service.api.validation import TextLimits
from service.tokenizer import Tokenizer, TooManyTokens
from tests.engines import build_tiny
from tests.servers import ServerThread, running_server
from tests.waiting import wait_until

pytestmark = pytest.mark.server

PROSE = "The keeper climbed the stairs at dusk, 1,204 steps, and lit the lamp for the ships. 灯塔 🌊 "
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


@pytest.fixture(scope="module")
def smollm2(smollm2_engine_dir: Path) -> Tokenizer:
    return Tokenizer.from_engine_dir(smollm2_engine_dir)


def _spin_rate(during: Callable[[], object] | None = None, solo_iterations: int = 2_000_000) -> float:
    """Iterations per second of a pure-Python loop in another thread: alone, or while `during` runs here."""
    stop, count, solo = threading.Event(), [0], []

    def spin() -> None:
        start, n = time.perf_counter(), 0
        while not stop.is_set():
            n += 1
            if during is None and n == solo_iterations:
                solo.append(n / (time.perf_counter() - start))
                return
        count[0] = n

    thread = threading.Thread(target=spin)
    thread.start()
    if during is None:
        thread.join()
        return solo[0]
    start = time.perf_counter()
    during()
    elapsed = time.perf_counter() - start
    stop.set()
    thread.join()
    return count[0] / elapsed


def _keeps_half_its_rate(during: Callable[[], object]) -> None:
    """Another thread keeps at least half its solo rate while `during` runs, in one of three back-to-back pairs of
    measurements (a busy box's other load moves both; holding the GIL drops it to a few percent every time)."""
    ratios = []
    for _ in range(3):
        solo = _spin_rate()
        ratios.append(_spin_rate(during) / solo)
        if ratios[-1] >= 0.5:
            return
    raise AssertionError(f"another thread ran at {', '.join(f'{r:.0%}' for r in ratios)} of its solo rate")


def test_encode_leaves_other_python_threads_running(smollm2: Tokenizer) -> None:
    text = (PROSE * 4000)[:400_000]  # about a second of tokenizing
    _keeps_half_its_rate(lambda: smollm2.encode(text))


def test_a_text_too_long_is_refused_from_a_prefix(smollm2: Tokenizer) -> None:
    text = PROSE * 6000  # ~570 KB, ~190,000 tokens
    with pytest.raises(TooManyTokens) as err:
        smollm2.encode(text, max_tokens=2048)
    assert err.value.at_least > 2048 and err.value.num_bytes < len(text.encode()) / 20
    fits = PROSE * 20
    assert smollm2.encode(fits, max_tokens=2048) == smollm2.encode(fits)  # the same ids when it fits
    with pytest.raises(TooManyTokens):
        smollm2.encode(fits, max_tokens=len(smollm2.encode(fits)) - 1)


def test_prefix_tokens_are_a_prefix_of_the_whole(smollm2: Tokenizer) -> None:
    """What the early refusal rests on: a prefix cut before a whitespace (after a non-space) tokenizes to a prefix
    of the whole text's tokens, for this tokenizer's pre-tokenizer (GPT-2 split, digits isolated)."""
    from service.tokenizer import _whitespace_cut

    text = PROSE * 30 + "  tabs\tand\nnew lines   and 1234567 numbers, ( brackets ) ... ok "
    for near in range(10, len(text), 37):
        cut = _whitespace_cut(text, near)
        if cut is not None:
            prefix = smollm2.encode(text[:cut])
            assert smollm2.encode(text)[: len(prefix)] == prefix, repr(text[cut - 10 : cut + 10])


def test_generate_refuses_a_prompt_too_long_after_a_prefix_over_a_socket(smollm2_engine_dir: Path) -> None:
    with running_server(smollm2_engine_dir) as srv:
        info = srv.stub().GetModelInfo(llm_pb2.GetModelInfoRequest())
        text = (PROSE * 10_000)[: info.max_text_bytes // 2]  # within the byte limit, far over the context
        with pytest.raises(grpc.RpcError) as err:
            list(srv.stub().Generate(llm_pb2.GenerateRequest(prompt=text)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = err.value.details()
        assert details.startswith("prompt (") and f"exceeds max_seq_len {info.max_seq_len}" in details
        counted = int(details.split("counted in its first ")[1].split(" bytes")[0])
        assert counted < len(text.encode()) / 5  # refused from a prefix, not after tokenizing all of it


def test_a_maximal_tokenize_leaves_the_server_process_running(smollm2_engine_dir: Path) -> None:
    """In the server's own process: a thread beside it keeps at least half its solo rate during the RPC."""
    with running_server(smollm2_engine_dir) as srv:
        info = srv.stub().GetModelInfo(llm_pb2.GetModelInfoRequest())
        text = (PROSE * 10_000)[: int(info.max_text_bytes * 0.9)]
        stub = srv.stub()
        _keeps_half_its_rate(lambda: stub.Tokenize(llm_pb2.TokenizeRequest(text=text), timeout=120))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory, "tiny-tokenize", max_batch_size=8, max_num_tokens=64, max_seq_len=1024)


def _stuck_tokenizer(srv: ServerThread, monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, list]:
    """Tokenize calls block in the pool until the returned event is set; the list counts those that entered."""
    tokenizer = srv.server.backend.core.tokenizer
    real = tokenizer.encode_with_tokens
    release, entered = threading.Event(), []

    def stuck(text: str, add_special_tokens: bool = True):
        entered.append(len(text))
        release.wait(60)
        return real(text, add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode_with_tokens", stuck)
    return release, entered


def test_tokenization_backlog_is_bounded_per_connection_and_per_server(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with running_server(tiny_dir, tokenize_backlog=2.0, tokenize_backlog_per_connection=1.0) as srv:
        limit = TextLimits.for_model(srv.server.backend.tokenizer, 1024).max_text_bytes
        release, entered = _stuck_tokenizer(srv, monkeypatch)
        big = llm_pb2.TokenizeRequest(text="a" * (limit - 10))
        stubs = [llm_pb2_grpc.LLMServiceStub(grpc.insecure_channel(srv.target, options=OWN_CONNECTION))
                 for _ in range(3)]  # fmt: skip
        try:
            first = stubs[0].Tokenize.future(big, timeout=60)
            wait_until(lambda: len(entered) == 1, "the first tokenization running")
            with pytest.raises(grpc.RpcError) as err:  # the same connection: its one text is in flight
                stubs[0].Tokenize(big, timeout=60)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "per connection" in err.value.details()
            second = stubs[1].Tokenize.future(big, timeout=60)  # another connection: room in the server's two
            wait_until(lambda: srv.server.edge.tokenization.bytes_in_flight >= 2 * (limit - 10), "two in flight")
            with pytest.raises(grpc.RpcError) as err:
                stubs[2].Tokenize(big, timeout=60)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "backlog is full" in err.value.details()
            small = stubs[2].Tokenize.future(llm_pb2.TokenizeRequest(text="small"), timeout=60)  # fits the budget
        finally:
            release.set()
        assert all(len(f.result().token_ids) > 0 for f in (first, second, small))
        wait_until(lambda: srv.server.edge.tokenization.bytes_in_flight == 0, "the backlog empty")


def test_a_tokenize_reply_over_the_message_limit_is_refused_by_its_size(tiny_dir: Path) -> None:
    with running_server(tiny_dir, max_message_bytes=24 * 1024) as srv:
        text = "東京" * 2000  # 12 KB of request; its ids and token strings come to several times that
        messages = llm_pb2.ChatMessages(messages=[llm_pb2.ChatMessage(role="user", content=text)])
        for req in (llm_pb2.TokenizeRequest(text=text), llm_pb2.TokenizeRequest(messages=messages)):
            with pytest.raises(grpc.RpcError) as err:
                srv.stub().Tokenize(req, timeout=60)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "Tokenize reply would be" in err.value.details() and "--max-message-bytes" in err.value.details()
        assert len(srv.stub().Tokenize(llm_pb2.TokenizeRequest(text="東京"), timeout=60).token_ids) > 0
