"""The Shepherd Model Gateway (smg, the real binary from PyPI) in front of this server's trtllm.TrtllmService, and
the real `openai` SDK in front of smg, all on loopback: chat and completions, streaming and not, give the same
greedy text as llm.v1 for the same prompt. smg takes the tokenizer bundle this server's GetTokenizer serves
(unzipped into a directory named after the served model, which is how smg 1.13.0 matches a --tokenizer-path
to a worker's model). Skipped, saying why, where smg or openai is not installed or the binary cannot run."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import re
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from smg_grpc_proto import trtllm_service_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2

from protos.llm.v1 import llm_pb2
from tests.servers import ServerThread, free_port, generate, ids_and_text, make_config, running_server
from tests.tcp_proxy import tcp_proxy
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.server]

openai = pytest.importorskip("openai", reason="the openai SDK is not installed (requirements-dev.txt pins it)")
SMG = shutil.which("smg")
COMPLETION = "The capital of France is"
QUESTION = "What is the capital of France?"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def worker(smollm2_engine_dir: Path) -> Iterator[ServerThread]:
    with running_server(smollm2_engine_dir) as srv:
        yield srv


def _bundle(worker: ServerThread, into: Path) -> None:
    chunks = list(pb_grpc.TrtllmServiceStub(worker.channel()).GetTokenizer(common_pb2.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    zipfile.ZipFile(io.BytesIO(data)).extractall(into)


def _ok(url: str) -> bool:
    try:
        body = (
            b'{"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 1, "temperature": 0}'  # a tokenizer and a worker
        )
        req = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
        return urllib.request.urlopen(req, timeout=10).status == 200
    except OSError:
        return False


@contextlib.contextmanager
def _smg(worker_target: str | list[str], model: str, run: Path, *args: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """smg launched in `run` (which holds the bundle as `run/model`) against the workers: (its URL, the process);
    its Prometheus endpoint is at _metrics_url(proc)."""
    if SMG is None:
        pytest.skip("the smg binary is not installed (pip install smg==1.13.0, requirements-dev.txt)")
    targets = [worker_target] if isinstance(worker_target, str) else worker_target
    port, prom = free_port(), free_port()
    cmd = [SMG, "launch", "--worker-urls", *(f"grpc://{t}" for t in targets), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom)]
    cmd += ["--tokenizer-path", model, *args]
    with (run / "smg.log").open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=run, stdout=log, stderr=subprocess.STDOUT)
        proc.metrics_url = f"http://127.0.0.1:{prom}/metrics"  # type: ignore[attr-defined]
        try:
            yield f"http://127.0.0.1:{port}", proc
        finally:
            proc.terminate()
            proc.wait(10)


def _wait_routing(url: str, proc: subprocess.Popen, run: Path, within: float = 60) -> None:
    def up() -> bool:
        if proc.poll() is not None:
            pytest.skip(f"smg exited with {proc.returncode}: {(run / 'smg.log').read_text()[-500:]}")
        return _ok(url)

    wait_until(up, "smg routing to the worker", within)


@pytest.fixture(scope="module")
def gateway(worker: ServerThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    run = tmp_path_factory.mktemp("smg")
    model = worker.server.backend.info.model_name
    _bundle(worker, run / model)
    with _smg(worker.target, model, run) as (url, proc):
        _wait_routing(url, proc, run)
        yield url


def _llm_v1(worker: ServerThread, **input_field) -> str:
    req = llm_pb2.GenerateRequest(
        sampling=llm_pb2.SamplingParams(temperature=0),
        stopping=llm_pb2.StoppingParams(max_tokens=MAX_TOKENS),
        **input_field,
    )
    chunks, _ = generate(worker.stub(), req)
    return ids_and_text(chunks)[1]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_through_smg_match_llm_v1(worker: ServerThread, gateway: str, stream: bool) -> None:
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="none")
    args = {"model": "smollm2-135m", "prompt": COMPLETION, "max_tokens": MAX_TOKENS, "temperature": 0}
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **args) if c.choices)
    else:
        text = client.completions.create(**args).choices[0].text
    assert text and text == _llm_v1(worker, prompt=COMPLETION)
    assert worker.idle()


@pytest.mark.parametrize("stream", [False, True])
def test_chat_through_smg_matches_llm_v1(worker: ServerThread, gateway: str, stream: bool) -> None:
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="none")
    messages = [{"role": "user", "content": QUESTION}]
    args = {"model": "smollm2-135m", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    if stream:
        parts = client.chat.completions.create(stream=True, **args)
        text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    else:
        text = client.chat.completions.create(**args).choices[0].message.content
    chat = llm_pb2.ChatMessages(messages=[llm_pb2.ChatMessage(role="user", content=QUESTION)])
    assert text and text == _llm_v1(worker, messages=chat)
    assert worker.idle()


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
RESPONSE_FORMATS = {
    "json_schema": ({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}, PERSON),
    "json_object": ({"type": "json_object"}, {"type": "object"}),  # smg sends it as the schema {"type": "object"}
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", sorted(RESPONSE_FORMATS))
def test_response_format_through_smg_is_valid_json(gateway: str, worker: ServerThread, kind: str, stream: bool) -> None:
    """OpenAI's response_format -> smg -> the worker door's guided_decoding -> the native engine's constraint."""
    jsonschema = pytest.importorskip("jsonschema")
    response_format, schema = RESPONSE_FORMATS[kind]
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="none")
    args = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": "Describe a person (name and age) as JSON."}],
        "max_tokens": 128,
        "temperature": 0,
        "response_format": response_format,
    }
    if stream:
        parts = list(client.chat.completions.create(stream=True, **args))
        text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
        finish = next(c.choices[0].finish_reason for c in reversed(parts) if c.choices and c.choices[0].finish_reason)
    else:
        choice = client.chat.completions.create(**args).choices[0]
        text, finish = choice.message.content, choice.finish_reason
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), schema)
    compiled = [json.loads(key[1]) for key in worker.core.grammars.keys() if key[0] == "json_schema"]
    assert schema in compiled  # the worker got the constraint (the text did not just happen to be JSON)
    assert worker.idle()


@pytest.mark.parametrize(
    "args",
    [
        {"max_tokens": 5000},  # past the context
        {"temperature": -1},
        {"model": "no-such-model"},
        {"prompt": "x" * 10_000_000},  # 10 MB
    ],
    ids=["max-tokens-past-context", "negative-temperature", "unknown-model", "10MB-prompt"],
)
def test_bad_input_through_smg_is_4xx(gateway: str, args: dict) -> None:
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="none", max_retries=0)
    body = {"model": "smollm2-135m", "prompt": COMPLETION, "max_tokens": 4, **args}
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(**body)
    assert 400 <= err.value.status_code < 500, (err.value.status_code, err.value.message)


def test_chat_prompt_ids_are_our_own_rendering(worker: ServerThread, gateway: str) -> None:
    """smg renders the chat template and tokenizes itself, from our bundle: the ids it sends are what our own
    chat rendering (llm.v1 Tokenize) gives."""
    backend = worker.server.backend
    sent: list[list[int]] = []
    real = backend.generate

    def spy(gen, on_done=None):
        sent.append(list(gen.prompt_token_ids))
        return real(gen, on_done)

    backend.generate = spy
    try:
        client = openai.OpenAI(base_url=gateway + "/v1", api_key="none")
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
        client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=2, temperature=0)
    finally:
        del backend.generate
    chat = llm_pb2.ChatMessages(messages=[llm_pb2.ChatMessage(**m) for m in messages])
    ours = worker.stub().Tokenize(llm_pb2.TokenizeRequest(messages=chat)).token_ids
    assert sent == [list(ours)]


def test_dropped_clients_leave_no_kv_blocks(worker: ServerThread, gateway: str) -> None:
    """A streaming client that goes away (smg sends Abort) and a non-streaming one (smg cancels the call)."""
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="none", max_retries=0)
    args = {"model": "smollm2-135m", "prompt": COMPLETION, "max_tokens": 1000, "temperature": 0}
    # a floor of 50 ms per step: 1000 tokens take over 50 s, so idle within 20 s means the request was aborted
    with worker.paced(min_step_s=0.05):
        stream = client.completions.create(stream=True, **args)
        next(iter(stream))
        stream.close()
        assert worker.idle(within=20), "a dropped streaming client left KV blocks behind"
        with pytest.raises(openai.APITimeoutError):
            client.with_options(timeout=1.0).completions.create(**args)
        assert worker.idle(within=20), "a dropped non-streaming client left KV blocks behind"


def test_a_worker_warming_up_gets_no_generate_then_joins(
    worker: ServerThread, smollm2_engine_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """smg registers a worker only once its HealthCheck says OK: while ours warms up every RPC is UNAVAILABLE, so
    a request through smg fails (never reaching an engine), and once warm smg's registration retries find it."""
    from service.api.server import LLMServer

    real = LLMServer._warm_up
    release = threading.Event()

    async def slow_warm_up(self, engine):
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 120)
        await real(self, engine)

    monkeypatch.setattr(LLMServer, "_warm_up", slow_warm_up)
    model = worker.server.backend.info.model_name
    _bundle(worker, tmp_path / model)  # the warm worker's bundle: the cold one answers UNAVAILABLE
    cold = ServerThread(make_config(smollm2_engine_dir)).start(wait_ready=False)
    try:
        wait_until(lambda: cold.server.port, "the port bound")
        with _smg(cold.target, model, tmp_path) as (url, proc):
            wait_until(lambda: _listening(url), "smg's HTTP port up", within=60)
            assert not _ok(url)  # no worker to route to: smg answers an error, not a completion
            assert cold.server.backend is None  # nothing could have generated
            release.set()
            cold.startup.result(timeout=120)
            _wait_routing(url, proc, tmp_path, within=120)
    finally:
        release.set()
        cold.stop()


def _listening(url: str) -> bool:
    try:
        urllib.request.urlopen(url + "/workers", timeout=5)
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def test_stop_string_is_stop_word_and_smg_trims_it(worker: ServerThread, gateway: str) -> None:
    """A stop string ends the request with finish_reason "stop_word" and matched_stop_str; the ids run up to the
    token that completed it, and smg's text ends before it, as llm.v1's does."""
    from smg_grpc_proto import trtllm_service_pb2 as pb

    ids = list(worker.stub().Tokenize(llm_pb2.TokenizeRequest(text=COMPLETION)).token_ids)
    req = pb.GenerateRequest(
        request_id="stop-word", tokenized=pb.TokenizedInput(input_token_ids=ids), max_tokens=MAX_TOKENS, stop=["answer"]
    )
    req.sampling_config.temperature = 0
    *_, last = pb_grpc.TrtllmServiceStub(worker.channel()).Generate(req)
    assert last.complete.finish_reason == "stop_word" and last.complete.matched_stop_str == "answer"
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="none")
    args = {"model": "smollm2-135m", "prompt": COMPLETION, "max_tokens": MAX_TOKENS, "temperature": 0}
    choice = client.completions.create(stop=["answer"], **args).choices[0]
    llm = llm_pb2.GenerateRequest(
        prompt=COMPLETION,
        sampling=llm_pb2.SamplingParams(temperature=0),
        stopping=llm_pb2.StoppingParams(max_tokens=MAX_TOKENS, stop=["answer"]),
    )
    assert choice.finish_reason == "stop" and choice.text == ids_and_text(generate(worker.stub(), llm)[0])[1]


# ---- KV events: smg's index holds our blocks and routes on them ---------------------------------------------------
def _smg_metric(proc: subprocess.Popen, name: str, worker: str) -> float:
    """The sum of smg's samples of `name` whose labels name `worker` (grpc://HOST:PORT)."""
    text = urllib.request.urlopen(proc.metrics_url, timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and f'worker="grpc://{worker}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _indexed(proc: subprocess.Popen, srv: ServerThread, target: str | None = None) -> bool:
    """smg's index holds exactly as many of the worker's blocks as its prefix cache does (and some)."""
    live = len(srv.server.backend.kv_events.live_block_hashes())
    return live > 0 and _smg_metric(proc, "smg_kv_index_blocks", target or srv.target) == live


def _warm(srv: ServerThread, prompt: str) -> None:
    """The prompt's KV into one worker's cache, behind the gateway's back (llm.v1, straight to the worker)."""
    req = llm_pb2.GenerateRequest(
        prompt=prompt, sampling=llm_pb2.SamplingParams(temperature=0), stopping=llm_pb2.StoppingParams(max_tokens=1)
    )
    generate(srv.stub(), req)


def _complete(url: str, prompt: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=2, temperature=0)


# each starts with its own words, so no two share a first block
PREFIXES = [f"Document {i}, section {i * 7}: " + "the assistant answers carefully and briefly. " * 8 for i in range(6)]


def test_cache_aware_routing_follows_our_kv_events(
    worker: ServerThread, smollm2_engine_dir: Path, tmp_path: Path
) -> None:
    """Two workers; each prefix warmed on one of them directly, so only the KV events can tell smg where it is:
    smg's index holds every block our caches hold, and each request on a warmed prefix goes to its holder (its
    prefix-cache hits grow there). By chance alone 6 of 6 would come 1 time in 64."""
    model = worker.server.backend.info.model_name
    _bundle(worker, tmp_path / model)
    with running_server(smollm2_engine_dir) as other:
        workers = [worker, other]
        with _smg([w.target for w in workers], model, tmp_path, "--policy", "cache_aware") as (url, proc):
            _wait_routing(url, proc, tmp_path)
            for i, prefix in enumerate(PREFIXES):
                _warm(workers[i % 2], prefix)
            for w in workers:
                wait_until(lambda: _indexed(proc, w), f"smg's index holding {w.target}'s blocks")  # noqa: B023
            assert all(_smg_metric(proc, "smg_kv_event_parentless_stores_total", w.target) == 0 for w in workers)
            for i, prefix in enumerate(PREFIXES):
                holder = workers[i % 2]
                before = holder.metric("llm_prefix_cache_hit_tokens_total")
                _complete(url, prefix + "Question: what does it say?")
                assert holder.metric("llm_prefix_cache_hit_tokens_total") > before, (
                    f"prefix {i} not routed to its holder"
                )
            assert all(w.idle() for w in workers)


def test_a_dropped_kv_event_stream_replays_without_loss(worker: ServerThread, tmp_path: Path) -> None:
    """The connection between smg and the worker is cut; the worker's cache changes meanwhile; smg reconnects,
    resumes from its last sequence number, and its index again holds exactly our blocks, with no gap counted
    and no resync."""
    model = worker.server.backend.info.model_name
    _bundle(worker, tmp_path / model)
    with (
        tcp_proxy(worker.target) as proxy,
        _smg(proxy.target, model, tmp_path, "--policy", "cache_aware") as (url, proc),
    ):
        _wait_routing(url, proc, tmp_path)
        _warm(worker, PREFIXES[0] + "one")
        wait_until(lambda: _indexed(proc, worker, proxy.target), "smg's index holding the worker's blocks")
        connected = _smg_metric(proc, "smg_kv_event_subscriptions_total", proxy.target)
        cursor = worker.server.backend.kv_events.last_seq
        proxy.partition(True)  # smg's stream is cut and cannot come back while the cache changes
        _warm(worker, PREFIXES[1] + "two")
        _warm(worker, PREFIXES[2] + "three")
        wait_until(lambda: worker.server.backend.kv_events.last_seq > cursor, "batches smg has not seen")
        proxy.partition(False)
        wait_until(
            lambda: _smg_metric(proc, "smg_kv_event_subscriptions_total", proxy.target) > connected,
            "smg resubscribing",
            within=60,
        )
        wait_until(lambda: _indexed(proc, worker, proxy.target), "the missed blocks in smg's index", within=60)
        log = re.sub(r"\x1b\[[0-9;]*m", "", (tmp_path / "smg.log").read_text())  # without its colours
        resumed = re.findall(r"KV event stream connected.* start_seq=(\d+)", log)
        assert resumed and int(resumed[-1]) > 0, "smg should resume from its cursor, not from zero"
        for name in ("smg_kv_event_gaps_total", "smg_kv_event_resyncs_total", "smg_kv_event_missed_batches_total"):
            assert _smg_metric(proc, name, proxy.target) == 0, name
