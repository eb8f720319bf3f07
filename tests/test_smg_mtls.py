"""smg 1.13.0's worker TLS flags (--client-cert-path, --client-key-path, --ca-cert-paths) against this server with
mutual TLS on its trtllm.TrtllmService door. Found by experiment: they configure only smg's HTTP client (HTTP
workers); a gRPC worker gets no TLS at all. `grpc://` speaks plaintext HTTP/2, which our TLS port drops ("broken
pipe"); `grpcs://` opens the TCP connection and gives up before any ClientHello (tonic's https without a TLS
config: "transport error"); worker URLs from `--discovery-provider file` go the same way. So no route to an mTLS
worker forms, with the client certificate or without it, and nothing reaches the engine; the same smg command
line routes to a plaintext worker. A deployment that needs TLS to the worker puts a TLS-originating sidecar
next to smg. Should a later smg speak TLS to gRPC workers, these tests fail and say so."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from protos.llm.v1 import llm_pb2, llm_pb2_grpc
from tests.servers import ServerThread, free_port, generate, ids_and_text, running_server
from tests.test_service_security import _ca, _leaf
from tests.test_smg_gateway import COMPLETION, MAX_TOKENS, SMG, _bundle, _llm_v1, _smg, _wait_routing, openai
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.server]

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _leaf(d, "server", "ca", "DNS:localhost,IP:127.0.0.1")  # the URLs name 127.0.0.1
    _leaf(d, "smg", "ca", "DNS:smg")
    return d


@pytest.fixture(scope="module")
def worker(smollm2_engine_dir: Path, pki: Path) -> Iterator[ServerThread]:
    tls = {
        "tls_cert": str(pki / "server.crt"),
        "tls_key": str(pki / "server.key"),
        "tls_client_ca": str(pki / "ca.crt"),
    }
    with running_server(smollm2_engine_dir, **tls) as srv:
        yield srv


def _channel(worker: ServerThread, pki: Path) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(*((pki / f).read_bytes() for f in ("ca.crt", "smg.key", "smg.crt")))
    return grpc.secure_channel(worker.target, creds)


def _flags(pki: Path, client_cert: bool = True) -> list[str]:
    flags = ["--ca-cert-paths", str(pki / "ca.crt")]
    if client_cert:
        flags += ["--client-cert-path", str(pki / "smg.crt"), "--client-key-path", str(pki / "smg.key")]
    return flags


@pytest.fixture
def run(worker: ServerThread, pki: Path, tmp_path: Path) -> Path:
    """A directory for smg: the tokenizer bundle (fetched over mutual TLS) as `run/MODEL`, and smg's log."""
    _bundle(SimpleNamespace(channel=lambda: _channel(worker, pki)), tmp_path / MODEL)
    return tmp_path


@contextlib.contextmanager
def _launch(run: Path, *args: str) -> Iterator[str]:
    """smg with `args` naming its workers; its URL. Its log is run/smg.log."""
    if SMG is None:
        pytest.skip("the smg binary is not installed (pip install smg==1.13.0, requirements-dev.txt)")
    port = free_port()
    cmd = [SMG, "launch", "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1"]
    cmd += ["--prometheus-port", str(free_port()), "--tokenizer-path", MODEL, *args]
    with (run / "smg.log").open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=run, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(10)


def _failed_registration(run: Path, url: str) -> str | None:
    """smg's log line saying that registering the worker `url` failed, if there is one yet."""
    log = re.sub(r"\x1b\[[0-9;]*m", "", (run / "smg.log").read_text(errors="replace"))
    for line in log.splitlines():
        if "Step failed" in line and f"worker URL {url}:" in line:
            return line
    return None


def test_worker_serves_llm_v1_over_mutual_tls(worker: ServerThread, pki: Path) -> None:
    req = llm_pb2.GenerateRequest(prompt=COMPLETION, stopping=llm_pb2.StoppingParams(max_tokens=MAX_TOKENS))
    chunks, _ = generate(llm_pb2_grpc.LLMServiceStub(_channel(worker, pki)), req)
    assert ids_and_text(chunks)[1]


@pytest.mark.parametrize(
    ("scheme", "discovery", "client_cert", "why"),
    [
        ("grpc", False, True, "broken pipe"),  # plaintext HTTP/2 into our TLS port
        ("grpcs", False, True, "gRPC connection failed: transport error"),  # no TLS config for https
        ("grpc", True, True, "broken pipe"),
        ("grpcs", True, True, "gRPC connection failed: transport error"),
        ("grpc", False, False, "broken pipe"),  # no client certificate either
    ],
    ids=["grpc", "grpcs", "discovery-grpc", "discovery-grpcs", "grpc-no-client-cert"],
)
def test_smg_gets_no_route_to_an_mtls_worker(
    worker: ServerThread, pki: Path, run: Path, scheme: str, discovery: bool, client_cert: bool, why: str
) -> None:
    url = f"{scheme}://{worker.target}"
    if discovery:
        manifest = run / "workers.json"
        manifest.write_text(json.dumps({"version": 1, "workers": [{"url": url, "model_id": MODEL}]}))
        where = ["--discovery-provider", "file", "--discovery-file", str(manifest)]
    else:
        where = ["--worker-urls", url]
    with _launch(run, *where, *_flags(pki, client_cert)) as gateway:
        line = wait_until(lambda: _failed_registration(run, url), "smg's failed registration of the worker", 60)
        assert why in line, line
        client = openai.OpenAI(base_url=gateway + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIStatusError) as err:  # no worker serves the model
            client.completions.create(model=MODEL, prompt=COMPLETION, max_tokens=MAX_TOKENS, temperature=0)
        assert err.value.status_code in (404, 503), (err.value.status_code, err.value.message)
    assert worker.idle()


def test_the_same_smg_flags_route_to_a_plaintext_worker(smollm2_engine_dir: Path, pki: Path, tmp_path: Path) -> None:
    """The control: the TLS flags are accepted, and ignored, on the gRPC path: the same greedy text as llm.v1."""
    with running_server(smollm2_engine_dir) as plain:
        _bundle(plain, tmp_path / MODEL)
        with _smg(plain.target, MODEL, tmp_path, *_flags(pki)) as (gateway, proc):
            _wait_routing(gateway, proc, tmp_path)
            client = openai.OpenAI(base_url=gateway + "/v1", api_key="none")
            args = {"model": MODEL, "prompt": COMPLETION, "max_tokens": MAX_TOKENS, "temperature": 0}
            text = client.completions.create(**args).choices[0].text
        assert text and text == _llm_v1(plain, prompt=COMPLETION)
