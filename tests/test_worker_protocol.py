"""TensorRT-LLM's worker protocol (trtllm.TrtllmService, service/api/worker/) over real sockets on 127.0.0.1, on
the llm.v1 server's own port: every GenerateRequest field honoured or refused by name, the same greedy tokens
as llm.v1, Abort and cancellation freeing every KV block, readiness, model / server info, the tokenizer bundle,
KV-cache events (stored blocks with their tokens, resumption without loss, snapshots, cursor errors)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import itertools
import json
import threading
import time
import zipfile
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import trtllm_service_pb2 as pb
from smg_grpc_proto import trtllm_service_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2

from protos.llm.v1 import llm_pb2
from service.api.worker import convert
from service.errors import InvalidRequest
from tests.engines import build_tiny
from tests.servers import ServerThread, generate, ids_and_text, make_config, running_server
from tests.waiting import wait_until

pytestmark = pytest.mark.server

PROMPT = [5, 17, 42, 99, 3, 250, 7]
_ids = itertools.count()


@pytest.fixture(scope="module")
def engine_dir(backend: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    limits = {"max_batch_size": 8, "max_num_tokens": 64, "max_seq_len": 1024}
    return build_tiny(tmp_path_factory, f"tiny-worker-{backend}", backend=backend, **limits)


@pytest.fixture(scope="module")
def server(engine_dir: Path):
    srv = ServerThread(make_config(engine_dir)).start()
    try:
        yield srv
    finally:
        srv.stop()


def _stub(server: ServerThread) -> pb_grpc.TrtllmServiceStub:
    return pb_grpc.TrtllmServiceStub(server.channel())


def _req(max_tokens: int = 8, streaming: bool = True, prompt: list[int] = PROMPT, **kw) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        request_id=f"w{next(_ids)}",
        tokenized=pb.TokenizedInput(input_token_ids=prompt),
        max_tokens=max_tokens,
        streaming=streaming,
        ignore_eos=True,
        **kw,
    )
    req.sampling_config.temperature = 0
    return req


def _run(stub, req: pb.GenerateRequest) -> tuple[list[pb.GenerateStreamChunk], pb.GenerateComplete]:
    chunks, complete = [], None
    for resp in stub.Generate(req):
        assert complete is None, "a message after the complete"
        assert resp.request_id == req.request_id
        if resp.HasField("chunk"):
            chunks.append(resp.chunk)
        else:
            complete = resp.complete
    assert complete is not None
    return chunks, complete


def _code(stub, req: pb.GenerateRequest) -> tuple[grpc.StatusCode, str]:
    try:
        _run(stub, req)
    except grpc.RpcError as err:
        return err.code(), err.details()
    return grpc.StatusCode.OK, ""


# ---- every field, from the descriptor ------------------------------------------------------------------------
def _leaf_paths(desc, prefix: str = "") -> list[tuple[str, FieldDescriptor]]:
    out = []
    for fd in desc.fields:
        path = prefix + fd.name
        if path in convert.CONTAINERS:
            out += _leaf_paths(fd.message_type, path + ".")
        else:
            out.append((path, fd))
    return out


FIELDS = _leaf_paths(pb.GenerateRequest.DESCRIPTOR)

# a valid value for each honoured field (a field honoured without one here fails the walk)
HONOURED_VALUES = {
    "request_id": "honoured-id",
    "tokenized.input_token_ids": [1, 2, 3],
    "tokenized.original_text": "the text the router tokenized",
    "sampling_config.beam_width": 1,
    "sampling_config.num_return_sequences": 1,
    "sampling_config.top_k": 5,
    "sampling_config.top_p": 0.9,
    "sampling_config.seed": 7,
    "sampling_config.temperature": 0.7,
    "sampling_config.min_tokens": 2,
    "sampling_config.repetition_penalty": 1.2,
    "sampling_config.presence_penalty": 0.5,
    "sampling_config.frequency_penalty": 0.5,
    "sampling_config.min_p": 0.05,
    "output_config.logprobs": 2,
    "output_config.exclude_input_from_output": True,
    "output_config.return_perf_metrics": True,
    "max_tokens": 4,
    "streaming": False,
    "cache_salt_id": 42,
    "arrival_time": 1.7e9,
    "stop": ["never-in-the-output"],
    "stop_token_ids": [3],
    "ignore_eos": False,
    "include_stop_token_in_output": True,
    "guided_decoding": pb.GuidedDecodingParams(guide_type=pb.GuidedDecodingParams.GUIDE_TYPE_REGEX, guide="[a-z ]+"),
}

_SAMPLE = {
    FieldDescriptor.TYPE_STRING: "x",
    FieldDescriptor.TYPE_BYTES: b"x",
    FieldDescriptor.TYPE_BOOL: True,
    FieldDescriptor.TYPE_FLOAT: 0.5,
    FieldDescriptor.TYPE_DOUBLE: 0.5,
}


def _set(req: Message, path: str, fd: FieldDescriptor, value: object = None) -> None:
    *parents, name = path.split(".")
    msg = req
    for p in parents:
        msg = getattr(msg, p)
    if fd.type == FieldDescriptor.TYPE_MESSAGE:
        if value is None:
            getattr(msg, name).SetInParent()
        else:
            getattr(msg, name).CopyFrom(value)
        return
    value = _SAMPLE.get(fd.type, 1) if value is None else value
    if fd.is_repeated:
        getattr(msg, name)[:] = value if isinstance(value, list) else [value]
    else:
        setattr(msg, name, value)


def test_every_field_is_in_one_table() -> None:
    paths = [p for p, _ in FIELDS]
    assert len(paths) > 40
    unknown = [p for p in paths if (p in convert.HONOURED) == (p in convert.REFUSED)]
    assert not unknown, f"fields in neither table (a new proto field?) or in both: {unknown}"
    assert set(convert.HONOURED) | set(convert.REFUSED) == set(paths), "a table names a field the proto lacks"
    assert set(HONOURED_VALUES) == set(convert.HONOURED)


# honoured by the protocol, refused by a backend that cannot do it (by name, as its own checks say)
BACKEND_REFUSES = {
    "native": set(),
    "trtllm": {"sampling_config.min_p", "output_config.logprobs"},
}


@pytest.mark.parametrize("path", [p for p, _ in FIELDS])
def test_each_field_honoured_or_refused_by_name(server: ServerThread, backend: str, path: str) -> None:
    fd = dict(FIELDS)[path]
    req = _req(max_tokens=4)
    if path == "guided_decoding":
        req.ignore_eos = False  # refused with a constraint: the grammar decides where the output ends
    if path in convert.REFUSED or path in BACKEND_REFUSES[backend]:
        _set(req, path, fd, HONOURED_VALUES.get(path) if path in BACKEND_REFUSES[backend] else None)
        code, details = _code(_stub(server), req)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (path, code, details)
        assert details.startswith((path + " ", path + ":")), details
    else:
        _set(req, path, fd, HONOURED_VALUES[path])
        code, details = _code(_stub(server), req)
        assert code == grpc.StatusCode.OK, (path, code, details)
    assert server.idle()


def test_a_field_unknown_to_this_server_is_refused_by_name() -> None:
    req = _req()
    req.lora_config.task_id = 3
    with pytest.raises(InvalidRequest, match=r"^lora_config is not supported"):
        convert.check_fields(req)
    saved = convert.HONOURED.pop("ignore_eos")  # as if the proto had grown a field the tables do not know
    try:
        with pytest.raises(InvalidRequest, match=r"^ignore_eos is not supported: this server does not know the field"):
            convert.check_fields(_req())
    finally:
        convert.HONOURED["ignore_eos"] = saved


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("sampling_config.beam_width", 2, "sampling_config.beam_width"),
        ("sampling_config.num_return_sequences", 2, "sampling_config.num_return_sequences"),
        ("sampling_config.temperature", -1.0, "sampling_config.temperature"),
        ("sampling_config.top_p", 2.0, "sampling_config.top_p"),
        ("sampling_config.seed", 2**63, "sampling_config.seed"),
        ("output_config.logprobs", 21, "output_config.logprobs"),
        ("max_tokens", 0, "max_tokens"),
        ("max_tokens", 5000, "max_tokens"),
        ("tokenized.input_token_ids", [], "tokenized.input_token_ids"),
        ("tokenized.input_token_ids", [10**6], "tokenized.input_token_ids"),
        ("stop_token_ids", [10**6], "stop_token_ids"),
        ("request_id", "has space", "request_id"),
    ],
)
def test_bad_values_are_invalid_argument_naming_the_field(
    server: ServerThread, field: str, value: object, named: str
) -> None:
    req = _req()
    _set(req, field, dict(FIELDS)[field], value)
    code, details = _code(_stub(server), req)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert named in details


# ---- what Generate streams -----------------------------------------------------------------------------------
def test_stream_is_llm_v1s_greedy_tokens(server: ServerThread) -> None:
    llm = llm_pb2.GenerateRequest(
        prompt_token_ids=llm_pb2.TokenIds(ids=PROMPT),
        sampling=llm_pb2.SamplingParams(temperature=0),
        stopping=llm_pb2.StoppingParams(max_tokens=12, ignore_eos=True),
    )
    chunks, _ = generate(server.stub(), llm)
    want, _ = ids_and_text(chunks)
    stub = _stub(server)
    streamed, complete = _run(stub, _req(max_tokens=12))
    assert [t for c in streamed for t in c.token_ids] == want == list(complete.output_token_ids)
    assert all(c.prompt_tokens == len(PROMPT) for c in streamed)
    assert [c.completion_tokens for c in streamed][-1] == 12
    assert complete.finish_reason == "length" and not complete.HasField("matched_stop_str")
    assert (complete.prompt_tokens, complete.completion_tokens) == (len(PROMPT), 12)
    only, complete = _run(stub, _req(max_tokens=12, streaming=False))
    assert only == [] and list(complete.output_token_ids) == want
    assert server.idle()


def test_stop_token_left_out_unless_asked(server: ServerThread) -> None:
    stub = _stub(server)
    _, full = _run(stub, _req(max_tokens=12))
    stop = full.output_token_ids[4]
    first = list(full.output_token_ids).index(stop)
    chunks, done = _run(stub, _req(max_tokens=12, stop_token_ids=[stop]))
    assert done.finish_reason == "stop" and done.matched_token_id == stop
    assert list(done.output_token_ids) == list(full.output_token_ids[:first])
    assert [t for c in chunks for t in c.token_ids] == list(done.output_token_ids)
    assert done.completion_tokens == first + 1  # the stop token was generated, and counts
    _, kept = _run(stub, _req(max_tokens=12, stop_token_ids=[stop], include_stop_token_in_output=True))
    assert list(kept.output_token_ids) == list(full.output_token_ids[: first + 1])


def test_logprobs_and_perf_metrics(server: ServerThread, backend: str) -> None:
    top = 0 if backend == "trtllm" else 2  # the trtllm backend returns the chosen token's only
    req = _req(max_tokens=5, output_config=pb.OutputConfig(logprobs=top, return_perf_metrics=True))
    before = time.time()
    chunks, done = _run(_stub(server), req)
    assert [lp.token_id for lp in done.logprobs] == list(done.output_token_ids)
    assert all(len(lp.top_logprobs) == top and lp.logprob <= 0 for lp in done.logprobs)
    assert sum(len(c.logprobs) for c in chunks) == 5
    m = done.perf_metrics
    assert before - 1 <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
    assert m.last_token_time <= time.time() + 1


# ---- Abort, cancellation -------------------------------------------------------------------------------------
def test_abort_and_cancellation_free_every_block(server: ServerThread) -> None:
    stub = _stub(server)
    with server.paced(min_step_s=0.002):
        req = _req(max_tokens=900)
        call = stub.Generate(req)
        next(call)  # running and streaming
        assert stub.Abort(pb.AbortRequest(request_id=req.request_id)).success
        rest = list(call)  # the stream ends with a complete that says so
        assert rest[-1].complete.finish_reason == "abort" and rest[-1].complete.prompt_tokens == len(PROMPT)
        assert server.idle(), "Abort left KV blocks or requests behind"
        assert not stub.Abort(pb.AbortRequest(request_id=req.request_id)).success  # gone already

        quiet = stub.Generate(_req(max_tokens=900, streaming=False))  # nothing arrives before the complete
        wait_until(lambda: server.server.backend.num_in_flight == 1, "the request running")
        quiet.cancel()
        assert server.idle(), "a cancelled non-streaming Generate left KV blocks or requests behind"


def test_a_request_id_in_flight_twice_is_refused(server: ServerThread) -> None:
    stub = _stub(server)
    with server.paced() as paced:
        req = _req(max_tokens=900)
        call = stub.Generate(req)
        next(call)
        paced.hold()
        code, details = _code(stub, req)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "already in flight" in details
        call.cancel()
    assert server.idle()


def test_overload_is_resource_exhausted(engine_dir: Path) -> None:
    with running_server(engine_dir, max_queue=1, max_num_seqs=1) as srv, srv.paced() as paced:
        stub = _stub(srv)
        running = stub.Generate(_req(max_tokens=900))
        next(running)  # it holds the only sequence slot
        paced.hold()
        queued = stub.Generate(_req(max_tokens=4))
        wait_until(lambda: srv.server.backend.num_in_flight == 2, "the second request queued")
        code, details = _code(stub, _req(max_tokens=4))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in details
        running.cancel()
        paced.release()
        assert list(queued)[-1].complete.finish_reason == "length"
        assert srv.idle()


# ---- readiness, info, the bundle -----------------------------------------------------------------------------
def test_every_rpc_unavailable_until_warm(engine_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.api.server import LLMServer

    real = LLMServer._warm_up
    release = threading.Event()

    async def slow_warm_up(self, engine):
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 60)
        await real(self, engine)

    monkeypatch.setattr(LLMServer, "_warm_up", slow_warm_up)
    srv = ServerThread(make_config(engine_dir)).start(wait_ready=False)
    try:
        wait_until(lambda: srv.server.port, "the port bound")
        stub = _stub(srv)
        calls = {
            "HealthCheck": lambda: stub.HealthCheck(pb.HealthCheckRequest()),
            "GetModelInfo": lambda: stub.GetModelInfo(pb.GetModelInfoRequest()),
            "GetServerInfo": lambda: stub.GetServerInfo(pb.GetServerInfoRequest()),
            "Abort": lambda: stub.Abort(pb.AbortRequest(request_id="x")),
            "Embed": lambda: stub.Embed(pb.EmbedRequest()),
            "Generate": lambda: list(stub.Generate(_req())),
            "GetTokenizer": lambda: list(stub.GetTokenizer(common_pb2.GetTokenizerRequest())),
            "SubscribeKvEvents": lambda: list(stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())),
        }
        methods = {m.name for m in pb.DESCRIPTOR.services_by_name["TrtllmService"].methods}
        assert set(calls) == methods
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, name
        assert srv.server.backend is None or srv.server.backend.num_in_flight == 0  # no Generate got through
        release.set()
        srv.startup.result(timeout=60)
        assert stub.HealthCheck(pb.HealthCheckRequest()).status == "OK"
        _run(stub, _req())
    finally:
        release.set()
        srv.stop()


def test_model_and_server_info(server: ServerThread, backend: str) -> None:
    stub = _stub(server)
    info = server.server.backend.info
    m = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (m.model_id, m.max_seq_len, m.max_input_len) == (info.model_name, 1024, 1023)
    assert (m.vocab_size, m.max_batch_size, m.num_layers) == (info.vocab_size, 8, info.num_layers)
    assert {"streaming", "logprobs", "seed", "min_p", "stop", "perf_metrics"} <= set(m.supported_features)
    s = stub.GetServerInfo(pb.GetServerInfoRequest())
    assert s.version.startswith("llm-grpc-serving ") and s.backend == backend and s.world_size == 1
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(pb.EmbedRequest())
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    health = health_pb2_grpc.HealthStub(server.channel())
    serving = health_pb2.HealthCheckResponse.SERVING
    assert health.Check(health_pb2.HealthCheckRequest(service="trtllm.TrtllmService")).status == serving


def test_reflection_lists_both_services(server: ServerThread) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(server.channel())
    resp = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"llm.v1.LLMService", "trtllm.TrtllmService", "grpc.health.v1.Health"} <= names


def test_tokenizer_bundle(server: ServerThread, engine_dir: Path) -> None:
    chunks = list(_stub(server).GetTokenizer(common_pb2.GetTokenizerRequest()))
    assert all(c.sha256 == "" for c in chunks[:-1])
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    z = zipfile.ZipFile(io.BytesIO(data))
    names = set(z.namelist())
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"} <= names
    assert len(names) <= 50
    assert z.read("tokenizer.json") == (engine_dir / "tokenizer.json").read_bytes()
    eos = list(server.server.backend.info.eos_token_ids)
    for name in ("config.json", "generation_config.json"):
        got = json.loads(z.read(name))["eos_token_id"]
        assert (got if isinstance(got, list) else [got]) == eos
    template = server.server.backend.tokenizer.chat_template
    assert json.loads(z.read("tokenizer_config.json")).get("chat_template") == template


# ---- KV-cache events ---------------------------------------------------------------------------------------
def _long(seed: int, n: int = 80) -> list[int]:
    return [(i * 37 + seed * 101) % 200 + 3 for i in range(n)]


class _Subscriber:
    """A SubscribeKvEvents stream read in a thread; `stored()` replays its events into block hash -> tokens."""

    def __init__(self, server: ServerThread, start: int = 0, loads_first: bool = True) -> None:
        req = common_pb2.SubscribeKvEventsRequest(
            start_sequence_number=start, load_records_before_first_batch=loads_first
        )
        self.call = _stub(server).SubscribeKvEvents(req)
        self.batches: list[common_pb2.KvEventBatch] = []
        self.error: grpc.RpcError | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                self.batches.append(batch)
        except grpc.RpcError as err:
            self.error = err

    def events(self) -> list[common_pb2.KvEventBatch]:
        return [b for b in list(self.batches) if b.events]

    def stored(self, into: dict[int, tuple[int | None, tuple[int, ...]]] | None = None) -> dict:
        """block hash -> (parent hash, token ids), as the events say the worker's cache stands."""
        blocks = {} if into is None else into
        for batch in self.events():
            for e in batch.events:
                kind = e.WhichOneof("data")
                if kind == "cleared":
                    blocks.clear()
                elif kind == "removed":
                    for h in e.removed.block_hashes:
                        blocks.pop(h, None)
                else:
                    parent = e.stored.parent_block_hash if e.stored.HasField("parent_block_hash") else None
                    for b in e.stored.blocks:
                        blocks[b.block_hash] = (parent, tuple(b.token_ids))
                        parent = b.block_hash
        return blocks

    def close(self) -> None:
        self.call.cancel()
        self._thread.join(10)


def _blocks_of(prompt: list[int], bs: int) -> set[tuple[int, ...]]:
    return {tuple(prompt[i * bs : (i + 1) * bs]) for i in range(len(prompt) // bs)}


def _holds(sub: _Subscriber, prompt: list[int], bs: int) -> bool:
    return _blocks_of(prompt, bs) <= {tokens for _, tokens in sub.stored().values()}


def test_kv_events_name_each_prompts_blocks_and_carry_the_load(server: ServerThread) -> None:
    info, log = server.server.backend.info, server.server.backend.kv_events
    bs, prompt = info.kv_block_size, _long(1)
    sub = _Subscriber(server)
    try:
        wait_until(lambda: sub.batches, "the first message")
        first = sub.batches[0]  # a load record, or the first batch replayed: it carries the load either way
        assert first.load.max_running_requests == info.max_batch_size and first.load.max_total_num_tokens > 0
        _run(_stub(server), _req(max_tokens=2, prompt=prompt))
        wait_until(lambda: _holds(sub, prompt, bs), "the prompt's full blocks stored")
        blocks = sub.stored()
        chain = [h for h, (_, tokens) in blocks.items() if tokens in _blocks_of(prompt, bs)]
        by_tokens = {blocks[h][1]: h for h in chain}
        for i in range(1, len(prompt) // bs):  # each block's parent is the one before it
            assert (
                blocks[by_tokens[tuple(prompt[i * bs : (i + 1) * bs])]][0]
                == by_tokens[tuple(prompt[(i - 1) * bs : i * bs])]
            )
        assert all(b.block_size == bs for batch in sub.events() for e in batch.events for b in e.stored.blocks)
        seqs = [b.sequence_number for b in sub.events()]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "event batches must be numbered without gaps"
        assert all(b.HasField("load") and not b.load.load_only for b in sub.events())
        wait_until(lambda: set(sub.stored()) == log.live_block_hashes(), "the stream in step with the cache")
        assert server.idle()
    finally:
        sub.close()


def test_a_dropped_subscription_resumes_without_loss(server: ServerThread) -> None:
    bs, log = server.server.backend.info.kv_block_size, server.server.backend.kv_events
    first, later = _long(2), _long(3)
    sub = _Subscriber(server)
    _run(_stub(server), _req(max_tokens=2, prompt=first))
    wait_until(lambda: _holds(sub, first, bs), "the first prompt's blocks stored")
    wait_until(lambda: set(sub.stored()) == log.live_block_hashes(), "the first stream caught up")
    sub.close()  # the subscriber drops; the cache goes on changing
    cursor = sub.events()[-1].sequence_number
    seen = sub.stored()
    _run(_stub(server), _req(max_tokens=2, prompt=later))
    wait_until(lambda: log.last_seq > cursor, "a batch published while nobody listened")
    again = _Subscriber(server, start=cursor)  # as smg resumes: from the last sequence it applied
    try:
        wait_until(lambda: _holds(again, later, bs), "the missed batches replayed")
        seqs = [b.sequence_number for b in again.events()]
        assert seqs[0] == cursor and seqs == list(range(cursor, cursor + len(seqs)))  # its last one again, no gap
        assert set(again.stored(into=seen)) == log.live_block_hashes()
    finally:
        again.close()


def test_past_the_history_a_snapshot_and_cursor_errors(engine_dir: Path) -> None:
    with running_server(engine_dir, **{"backend.kv_event_history": 2}) as srv:
        log, bs = srv.server.backend.kv_events, srv.server.backend.info.kv_block_size
        assert log.last_seq < log.first_ever  # nothing published yet (the warm-up fills no block)
        early = _Subscriber(srv)  # asks for load records before the first batch
        wait_until(lambda: early.batches, "the first load record")
        assert early.batches[0].load.load_only and early.batches[0].sequence_number == 0
        assert not early.batches[0].events and early.batches[0].load.max_total_num_tokens > 0
        early.close()
        for seed in range(4, 8):  # more batches than the history keeps
            before = log.last_seq
            _run(_stub(srv), _req(max_tokens=2, prompt=_long(seed)))
            wait_until(lambda: log.last_seq > before, "the prompt's blocks published")  # noqa: B023
        assert not log.complete()
        sub = _Subscriber(srv, loads_first=False)
        try:
            last_chunk = lambda: any(b.snapshot.count and b.snapshot.index == b.snapshot.count - 1 for b in sub.batches)  # noqa: E731
            wait_until(last_chunk, "a whole snapshot")
            chunks = [b for b in sub.batches if b.HasField("snapshot")]
            snap = chunks[-1].sequence_number  # the log position the snapshot stands for
            assert chunks[0].events[0].WhichOneof("data") == "cleared" and snap <= log.last_seq
            # what the backend publishes after the snapshot (its last request's late events, on a loaded box)
            # follows it without a gap, and the two together are the cache as it stands
            last = lambda: max(b.sequence_number for b in list(sub.batches) if b.events)  # noqa: E731
            wait_until(lambda: last() == log.last_seq, "the events after the snapshot")
            tail = [b.sequence_number for b in sub.events() if not b.HasField("snapshot")]
            assert tail == list(range(snap + 1, snap + 1 + len(tail)))
            assert set(sub.stored()) == log.live_block_hashes() and sub.stored()
            for seed in range(4, 8):
                assert _holds(sub, _long(seed), bs), "a live block missing from the snapshot"
        finally:
            sub.close()
        for start, words in ((log.first_ever, "before the history"), (log.last_seq + 5, "restarted")):
            old = _Subscriber(srv, start=start)
            old._thread.join(30)
            assert old.error is not None and old.error.code() == grpc.StatusCode.OUT_OF_RANGE, start
            assert words in old.error.details() and "resubscribe from zero" in old.error.details()
    with running_server(engine_dir, **{"backend.kv_event_history": 0}) as srv:
        off = _Subscriber(srv)
        off._thread.join(30)
        assert off.error is not None and off.error.code() == grpc.StatusCode.UNIMPLEMENTED


def test_subscriptions_hold_rpc_slots_and_end_on_drain(engine_dir: Path) -> None:
    """A client opening subscriptions without end is bounded like any other stream: past its connection's share
    RESOURCE_EXHAUSTED; a cancelled one gives its slot back; a drain ends the rest (UNAVAILABLE), promptly."""
    with running_server(engine_dir, max_concurrent_rpcs=4) as srv:
        subs = [_Subscriber(srv) for _ in range(2)]  # one connection: its share is 2
        wait_until(lambda: all(s.batches for s in subs), "two subscriptions streaming")
        extra = _Subscriber(srv)
        extra._thread.join(30)
        assert extra.error is not None and extra.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert srv.server.edge.num_active == 2
        subs[0].close()
        wait_until(lambda: srv.server.edge.num_active == 1, "the cancelled subscription's slot back")
        srv.run(srv.server.drain_and_stop(10))
        subs[1]._thread.join(30)
        assert subs[1].error is not None and subs[1].error.code() == grpc.StatusCode.UNAVAILABLE
        assert "resubscribe to another worker" in subs[1].error.details()  # its own end, not the drain timeout's cut
        assert srv.server.edge.num_active == 0
