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
def _smg(worker_target: str, model: str, run: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """smg launched in `run` (which holds the bundle as `run/model`) against one worker: (its URL, the process)."""
    if SMG is None:
        pytest.skip("the smg binary is not installed (pip install smg==1.13.0, requirements-dev.txt)")
    port = free_port()
    cmd = [SMG, "launch", "--worker-urls", f"grpc://{worker_target}", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--tokenizer-path", model]
    with (run / "smg.log").open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=run, stdout=log, stderr=subprocess.STDOUT)
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
