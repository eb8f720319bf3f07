"""The Triton front door's HTTP/REST protocol (--triton-http-port) against the native backend, over real sockets:
tritonclient.http for health, metadata, configuration, statistics and infer (JSON and binary tensors), raw HTTP
for Triton's generate / generate_stream (server-sent events) and for what a client can get wrong. The same text as
llm.v1 and as the gRPC door, the same refusals (as HTTP statuses), auth, RPC slots, cancellation and drain. Every
test ends with every KV block back."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from build_engine.triton_models.tables import MODELS
from protos.llm.v1 import llm_pb2
from tests.engines import build_tiny
from tests.servers import ServerThread, generate, ids_and_text, make_config, running_server
from tests.waiting import wait_until

pytestmark = pytest.mark.server

PROMPTS = ("Hello there", "The capital of France is", "1, 2, 3, 4,")
VARIED = {"temperature": 10.0, "seed": 7}  # seeded sampling: varied text (partial UTF-8 included), see frontdoor
NUMPY = {"BOOL": np.bool_, "INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32}


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory, "tiny-triton-http", max_batch_size=16, max_num_tokens=64, max_seq_len=1024)


@pytest.fixture(scope="module")
def server(engine_dir: Path):
    with running_server(engine_dir, triton_http_port=0, triton_port=0) as s:
        yield s


@pytest.fixture
def url(server: ServerThread) -> str:
    yield f"127.0.0.1:{server.server.triton_http_port}"
    assert server.idle(), "a request is still in flight or holds KV blocks"


# ---- clients ---------------------------------------------------------------------------------------------------
def post(url: str, path: str, body: dict | bytes, headers: dict | None = None) -> tuple[int, dict, bytes]:
    """One HTTP request: (status, headers, body)."""
    conn = http.client.HTTPConnection(url, timeout=60)
    try:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST" if body is not None else "GET", path, raw, headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def get(url: str, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection(url, timeout=60)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def error_of(reply: tuple[int, dict, bytes]) -> tuple[int, str]:
    status, headers, body = reply
    assert headers["content-type"].startswith("application/json"), headers
    return status, json.loads(body)["error"]


class Events:
    """One generate_stream call read event by event (SSE `data:` lines), its connection closable mid-stream. The
    request is sent at once; the response is read from the first use on (its headers come with the first event)."""

    def __init__(self, url: str, model: str, body: dict, headers: dict | None = None) -> None:
        self.conn = http.client.HTTPConnection(url, timeout=60)
        self.conn.request("POST", f"/v2/models/{model}/generate_stream", json.dumps(body).encode(), headers or {})
        self._resp: http.client.HTTPResponse | None = None

    @property
    def resp(self) -> http.client.HTTPResponse:
        if self._resp is None:
            self._resp = self.conn.getresponse()
        return self._resp

    def next(self) -> dict | None:
        """The next event's JSON, or None at the end of the stream."""
        while True:
            line = self.resp.readline()
            if not line:
                return None
            if line.startswith(b"data: "):
                assert self.resp.readline() == b"\n", "an event ends with a blank line"
                return json.loads(line[len(b"data: ") :])

    def all(self) -> list[dict]:
        events = []
        while (event := self.next()) is not None:
            events.append(event)
        return events

    def close(self) -> None:
        self.conn.close()


def stream_events(url: str, model: str, body: dict) -> list[dict]:
    s = Events(url, model, body)
    try:
        assert s.resp.status == 200 and s.resp.getheader("Content-Type") == "text/event-stream; charset=utf-8"
        return s.all()
    finally:
        s.close()


def http_inputs(model: str, binary: bool, **values) -> list[th.InferInput]:
    """tritonclient.http inputs of `model` ([1, 1] scalars, [1, n] lists), as binary tensors or JSON `data`."""
    tensors = []
    for name, value in values.items():
        datatype = MODELS[model].input(name).datatype
        if datatype == "BYTES":
            arr = np.array([[v.encode() for v in (value if isinstance(value, list) else [value])]], dtype=np.object_)
        else:
            arr = np.array(value, dtype=NUMPY[datatype])
            arr = arr.reshape(1, *arr.shape) if arr.ndim else arr.reshape(1, 1)
        t = th.InferInput(name, list(arr.shape), datatype)
        t.set_data_from_numpy(arr, binary_data=binary)
        tensors.append(t)
    return tensors


def _llm(server: ServerThread, prompt: str, max_tokens: int, **sampling) -> tuple[str, list[int]]:
    req = llm_pb2.GenerateRequest(
        prompt=prompt,
        sampling=llm_pb2.SamplingParams(**({"temperature": 0} | sampling)),
        stopping=llm_pb2.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    chunks, _ = generate(server.stub(), req, timeout=60)
    ids, text = ids_and_text(chunks)
    return text, ids


def _text(arr: np.ndarray) -> str:
    """BYTES output elements as text: bytes when they came binary, str when they came as JSON data."""
    return "".join(v.decode() if isinstance(v, bytes) else v for v in arr.reshape(-1))


def _prompt_ids(server: ServerThread, prompt: str) -> list[int]:
    return list(server.stub().Tokenize(llm_pb2.TokenizeRequest(text=prompt)).token_ids)


# ---- the Must-show checks: greedy text through `ensemble` over HTTP equals llm.v1's ----------------------------
def test_generate_and_generate_stream_equal_llm_v1(server: ServerThread, url: str) -> None:
    for i, prompt in enumerate(PROMPTS):
        text, _ = _llm(server, prompt, 24)
        body = {"id": f"g{i}", "text_input": prompt, "max_tokens": 24, "end_id": -1}
        status, headers, raw = post(url, "/v2/models/ensemble/generate", body)
        assert status == 200 and headers["content-type"] == "application/json"
        # not streaming, TensorRT-LLM returns the prompt's text first unless asked not to
        assert json.loads(raw) == {"id": f"g{i}", "model_name": "ensemble", "model_version": "1",
                                   "text_output": prompt + text}  # fmt: skip
        excluded = post(url, "/v2/models/ensemble/generate", {**body, "parameters": {"exclude_input_in_output": True}})
        assert json.loads(excluded[2])["text_output"] == text
        events = stream_events(url, "ensemble", {**body, "stream": True})
        assert events and "".join(e["text_output"] for e in events) == text  # deltas may merge
        assert all(e["id"] == f"g{i}" and e["model_name"] == "ensemble" for e in events)
        # sampled with a seed: the detokenizer's pieces concatenate to llm.v1's text on both paths
        varied, _ = _llm(server, prompt, 24, **VARIED)
        sampled = {"text_input": prompt, "max_tokens": 24, "end_id": -1, "top_p": 1.0, "stream": True, **VARIED}
        assert "".join(e["text_output"] for e in stream_events(url, "ensemble", sampled)) == varied


def test_generate_pads_values_to_the_model_shapes(server: ServerThread, url: str) -> None:
    """Triton's generate mapping: scalars and lists become [1, 1] / [1, n] tensors by the model's metadata, keys
    in `parameters` too; keys that are no input are request parameters."""
    prompt = PROMPTS[1]
    full, _ = _llm(server, prompt, 30, **VARIED)
    stop = full[10:13]
    body = {"text_input": prompt, "max_tokens": 30, "parameters": {"end_id": -1, "top_p": 1.0, **VARIED},
            "stop_words": [stop, ""], "stream": True, "unknown_parameter": "ignored"}  # fmt: skip
    assert "".join(e["text_output"] for e in stream_events(url, "ensemble", body)) == full[: full.index(stop)]
    prompt_ids = _prompt_ids(server, prompt)
    _, greedy_ids = _llm(server, prompt, 8)
    tok = {"input_ids": prompt_ids, "input_lengths": len(prompt_ids), "request_output_len": 8,
           "exclude_input_in_output": True}  # fmt: skip
    reply = json.loads(post(url, "/v2/models/tensorrt_llm/generate", tok)[2])
    assert reply["output_ids"] == greedy_ids and reply["sequence_length"] == 8  # 8 ids: a list; one: a scalar


def test_infer_json_and_binary_equal_llm_v1(server: ServerThread, url: str) -> None:
    client = th.InferenceServerClient(url)
    prompt = PROMPTS[1]
    text, ids = _llm(server, prompt, 20)
    for binary in (True, False):
        tensors = http_inputs("ensemble_sync", binary, text_input=prompt, max_tokens=20, end_id=-1,
                              exclude_input_in_output=True)  # fmt: skip
        outputs = [th.InferRequestedOutput("text_output", binary_data=binary)]
        result = client.infer("ensemble_sync", tensors, outputs=outputs, request_id="r1")
        assert _text(result.as_numpy("text_output")) == text
        assert result.get_response()["id"] == "r1" and result.get_response()["model_name"] == "ensemble_sync"
        raw = result.get_response()["outputs"][0]
        assert ("parameters" in raw) == binary and ("data" in raw) == (not binary)
    # no outputs named: tritonclient asks for every output in binary (binary_data_output)
    prompt_ids = _prompt_ids(server, prompt)
    tok_inputs = http_inputs("tensorrt_llm_sync", True, input_ids=prompt_ids, input_lengths=len(prompt_ids),
                             request_output_len=20)  # fmt: skip
    tok = client.infer("tensorrt_llm_sync", tok_inputs)
    assert tok.as_numpy("output_ids").reshape(-1).tolist() == prompt_ids + ids
    assert tok.as_numpy("sequence_length").reshape(-1).tolist() == [len(prompt_ids) + 20]
    # the same request through the gRPC door answers the same
    grpc_client = tg.InferenceServerClient(f"127.0.0.1:{server.server.triton_port}")
    g = tg.InferInput("text_input", [1, 1], "BYTES")
    g.set_data_from_numpy(np.array([[prompt.encode()]], dtype=np.object_))
    n = tg.InferInput("max_tokens", [1, 1], "INT32")
    n.set_data_from_numpy(np.array([[20]], dtype=np.int32))
    assert grpc_client.infer("ensemble_sync", [g, n]).as_numpy("text_output").reshape(-1)[0].decode() == prompt + text


def test_a_decoupled_model_refuses_infer_and_streams_through_generate_stream(url: str) -> None:
    client = th.InferenceServerClient(url)
    with pytest.raises(InferenceServerException) as err:
        client.infer("ensemble", http_inputs("ensemble", True, text_input="Hi", max_tokens=4))
    assert err.value.status() == "501"  # Triton: UNSUPPORTED
    assert err.value.message() == "HTTP end point doesn't support models with decoupled transaction policy"
    events = stream_events(url, "ensemble", {"text_input": "Hi", "max_tokens": 4, "stream": True})
    assert events and all("text_output" in e for e in events)
    # /generate wants exactly one response: a streaming request is refused before it runs
    status, message = error_of(post(url, "/v2/models/ensemble/generate", {"text_input": "Hi", "max_tokens": 4,
                                                                          "stream": True}))  # fmt: skip
    assert status == 400 and message.startswith("generate expects model to produce exactly 1 response")
    with pytest.raises(InferenceServerException, match="Streaming is only supported in decoupled mode"):
        client.infer("ensemble_sync", http_inputs("ensemble_sync", True, text_input="Hi", max_tokens=4, stream=True))


def test_health_metadata_config_and_statistics(server: ServerThread, url: str) -> None:
    client = th.InferenceServerClient(url)
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "llm-grpc-serving" and "binary_tensor_data" in meta["extensions"]
    grpc_client = tg.InferenceServerClient(f"127.0.0.1:{server.server.triton_port}")
    for name, spec in MODELS.items():
        assert client.is_model_ready(name) and client.is_model_ready(name, "1")
        md = client.get_model_metadata(name)
        assert md["name"] == name and md["versions"] == ["1"]
        assert {(t["name"], t["datatype"], tuple(t["shape"])) for t in md["inputs"]} == {
            (t.name, t.datatype, (-1, *t.dims)) for t in spec.served_inputs
        }  # shapes as JSON numbers, the batch dimension first
        # the JSON configuration is the gRPC door's message, field for field
        config = json_format.ParseDict(client.get_model_config(name), model_config_pb2.ModelConfig())
        assert config == grpc_client.get_model_config(name).config
    assert not client.is_model_ready("nope") and not client.is_model_ready("ensemble", "2")
    with pytest.raises(InferenceServerException) as err:
        client.get_model_metadata("nope")
    assert err.value.status() == "404" and err.value.message() == "Request for unknown model: 'nope' is not found"
    # statistics count HTTP requests, in the same table as the gRPC door's
    before = client.get_inference_statistics("ensemble")["model_stats"][0]["inference_stats"]
    post(url, "/v2/models/ensemble/generate", {"text_input": "Hi", "max_tokens": 2})
    post(url, "/v2/models/ensemble/generate", {"text_input": "Hi", "max_tokens": 0})  # refused: max_tokens >= 1
    after = client.get_inference_statistics("ensemble")["model_stats"][0]["inference_stats"]
    assert after["success"]["count"] == before["success"]["count"] + 1
    assert after["fail"]["count"] == before["fail"]["count"] + 1
    grpc_stats = grpc_client.get_inference_statistics("ensemble").model_stats[0].inference_stats
    assert grpc_stats.success.count == after["success"]["count"]
    assert len(client.get_inference_statistics()["model_stats"]) == len(MODELS)  # /v2/models/stats: every model
    assert {m["name"] for m in json.loads(post(url, "/v2/repository/index", {})[2])} == set(MODELS)


def test_bad_requests_are_refused_naming_the_field(url: str) -> None:
    text = {"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": ["Hi"]}
    n = {"name": "max_tokens", "shape": [1, 1], "datatype": "INT32", "data": [4]}
    infer = "/v2/models/ensemble_sync/infer"
    cases = {
        "not JSON": (infer, b"{bad", 400, "failed to parse the inference request JSON"),
        "no inputs": (infer, {"id": "x"}, 400, "'inputs' is required"),
        "wrong datatype": (infer, {"inputs": [text, {**n, "datatype": "FP32", "data": [4.0]}]}, 400,
                           "unexpected datatype FP32 for inference input 'max_tokens', expecting INT32"),
        "string for a number": (infer, {"inputs": [text, {**n, "data": ["4"]}]}, 400,
                                "input 'max_tokens' of datatype INT32 takes JSON integers"),
        "too many values": (infer, {"inputs": [text, {**n, "data": [4, 5]}]}, 400,
                            "input 'max_tokens' has more than 1 values in 'data'; its shape needs 1"),
        "negative shape": (infer, {"inputs": [text, {**n, "shape": [1, -1]}]}, 400, "Unable to parse 'shape'"),
        "missing input": (infer, {"inputs": [text]}, 400, "missing required input(s) 'max_tokens'"),
        "data and binary": (infer, {"inputs": [text, {**n, "parameters": {"binary_data_size": 4}}]}, 400,
                            "Input must set only one of the following fields"),
        "binary past the end": (infer, {"inputs": [text, {**{k: v for k, v in n.items() if k != "data"},
                                                          "parameters": {"binary_data_size": 4}}]}, 400,
                                "expecting 4 additional bytes"),
        "reserved parameter": (infer, {"inputs": [text, n], "parameters": {"triton_enable_empty_final_response": True}},
                               400, "parameter keys starting with 'triton_' are reserved"),
        "bad parameter": (infer, {"inputs": [text, n], "parameters": {"x": [1]}}, 400,
                          "parameter 'x' has invalid type"),
        "unknown output": (infer, {"inputs": [text, n], "outputs": [{"name": "logits"}]}, 400,
                           "unexpected inference output 'logits'"),
        "bad value": (infer, {"inputs": [text, {**n, "data": [-3]}]}, 400, "max_tokens must be >= 1"),
        "unknown model": ("/v2/models/nope/infer", {"inputs": [text, n]}, 404,
                          "Request for unknown model: 'nope' is not found"),
        "unknown version": ("/v2/models/ensemble_sync/versions/2/infer", {"inputs": [text, n]}, 404, "version 2"),
        "generate: not JSON": ("/v2/models/ensemble/generate", b"[1", 400, "failed to parse the generate request JSON"),
        "generate: wrong type": ("/v2/models/ensemble/generate", {"text_input": "Hi", "max_tokens": "8"}, 400,
                                 "input 'max_tokens' of datatype INT32 takes JSON integers"),
        "generate: temperature": ("/v2/models/ensemble/generate", {"text_input": "Hi", "max_tokens": 4,
                                                                   "temperature": -1.0}, 400,
                                  "temperature must be a finite number >= 0, got -1.0"),
        "generate: no text": ("/v2/models/ensemble/generate", {"max_tokens": 4}, 400,
                              "missing required input(s) 'text_input'"),
        "generate: unknown model": ("/v2/models/nope/generate_stream", {"text_input": "Hi"}, 404,
                                    "Request for unknown model: 'nope' is not found"),
        "generate: too long": ("/v2/models/ensemble/generate_stream", {"text_input": "Hi", "max_tokens": 5000}, 400,
                               "exceeds max_seq_len"),
        "not supported": ("/v2/repository/models/ensemble/load", {}, 501, "is not supported by this server"),
    }  # fmt: skip
    for name, (path, body, status, expected) in cases.items():
        got_status, message = error_of(post(url, path, body))
        assert (got_status, expected in message) == (status, True), (name, got_status, message)
    assert error_of(get(url, "/v2/models/ensemble/infer")) == (405, "Method Not Allowed")
    assert error_of(get(url, "/v2/nothing-here")) == (404, "Not Found")


def test_binary_tensors_by_hand(server: ServerThread, url: str) -> None:
    """The binary tensor extension on the wire: Inference-Header-Content-Length, binary_data_size in order,
    binary_data per output; the response's header length splits JSON from the bytes that follow."""
    prompt = PROMPTS[0]
    text, _ = _llm(server, prompt, 6)
    raw_text = len(prompt.encode()).to_bytes(4, "little") + prompt.encode()
    header = json.dumps({
        "inputs": [
            {"name": "text_input", "shape": [1, 1], "datatype": "BYTES",
             "parameters": {"binary_data_size": len(raw_text)}},
            {"name": "max_tokens", "shape": [1, 1], "datatype": "INT32", "parameters": {"binary_data_size": 4}},
            {"name": "exclude_input_in_output", "shape": [1, 1], "datatype": "BOOL", "data": [True]},
            {"name": "end_id", "shape": [1, 1], "datatype": "INT32", "data": [-1]},
        ],
        "outputs": [{"name": "text_output", "parameters": {"binary_data": True}}],
    }).encode()  # fmt: skip
    body = header + raw_text + np.int32(6).tobytes()
    status, headers, reply = post(url, "/v2/models/ensemble_sync/infer", body,
                                  {"Inference-Header-Content-Length": str(len(header))})  # fmt: skip
    assert status == 200 and headers["content-type"] == "application/octet-stream"
    split = int(headers["inference-header-content-length"])
    doc, data = json.loads(reply[:split]), reply[split:]
    (out,) = doc["outputs"]
    assert out["name"] == "text_output" and out["parameters"]["binary_data_size"] == len(data)
    assert data[4:].decode() == text and int.from_bytes(data[:4], "little") == len(text.encode())
    extra = post(url, "/v2/models/ensemble_sync/infer", body + b"x",
                 {"Inference-Header-Content-Length": str(len(header))})  # fmt: skip
    assert error_of(extra) == (400, "unexpected additional input data for model 'ensemble_sync'")
    no_header = post(url, "/v2/models/ensemble_sync/infer", body, {"Inference-Header-Content-Length": "0"})
    assert error_of(no_header)[0] == 400


def test_auth_refusals(engine_dir: Path, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    with running_server(engine_dir, auth_token_file=str(token), triton_http_port=0) as srv:
        url = f"127.0.0.1:{srv.server.triton_http_port}"
        for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/ensemble/ready"):  # health: no token
            assert get(url, path)[0] == 200
        status, headers, _ = get(url, "/v2/models/ensemble")
        assert status == 401 and headers["www-authenticate"] == "Bearer"
        assert error_of(get(url, "/v2/models/ensemble", {"Authorization": "Bearer wrong"})) == (
            403, "missing or invalid bearer token")  # fmt: skip
        body = {"text_input": "Hi", "max_tokens": 2}
        assert post(url, "/v2/models/ensemble/generate", body)[0] == 401
        good = {"Authorization": "Bearer s3cret"}
        client = th.InferenceServerClient(url)
        assert client.get_model_metadata("ensemble", headers=good)["name"] == "ensemble"
        assert post(url, "/v2/models/ensemble/generate", body, good)[0] == 200
        with pytest.raises(InferenceServerException) as err:
            client.get_model_config("ensemble")
        assert err.value.status() == "401"


def test_salt_per_token_covers_http_requests(engine_dir: Path, tmp_path: Path) -> None:
    """--cache-salt-per-token: an HTTP request's prefix blocks are shared only with requests of its own token."""
    tokens = tmp_path / "tokens"
    tokens.write_text("alpha-token\nbeta-token\n")
    prompt = "A prompt long enough to fill several KV cache blocks of the tiny model, " * 3
    with running_server(engine_dir, auth_token_file=str(tokens), cache_salt_per_token=True,
                        triton_http_port=0) as srv:  # fmt: skip
        url = f"127.0.0.1:{srv.server.triton_http_port}"
        body = {"text_input": prompt, "max_tokens": 2}
        assert post(url, "/v2/models/ensemble/generate", body, {"Authorization": "Bearer alpha-token"})[0] == 200

        def cached(token: str) -> int:
            req = llm_pb2.GenerateRequest(prompt=prompt, sampling=llm_pb2.SamplingParams(temperature=0),
                                          stopping=llm_pb2.StoppingParams(max_tokens=2, ignore_eos=True))  # fmt: skip
            _, complete = generate(srv.stub(), req, metadata=[("authorization", f"Bearer {token}")], timeout=30)
            return complete.usage.cached_prompt_tokens

        assert cached("beta-token") == 0  # another tenant: nothing shared with the HTTP request
        assert cached("alpha-token") > 0  # the same tenant over llm.v1: the HTTP request's blocks


def test_body_limits(engine_dir: Path) -> None:
    with running_server(engine_dir, triton_http_port=0, max_message_bytes=4096) as srv:
        url = f"127.0.0.1:{srv.server.triton_http_port}"
        status, message = error_of(post(url, "/v2/models/ensemble/generate", {"text_input": "a" * 9000}))
        assert status == 413 and "Maximum request body size 8192 exceeded" in message  # the transport's bound
        status, message = error_of(post(url, "/v2/models/ensemble/generate", {"text_input": "a" * 5000}))
        assert status == 413 and "over the server's limit of 4096 (--max-message-bytes)" in message  # the tensors'
        assert post(url, "/v2/models/ensemble/generate", {"text_input": "a" * 100, "max_tokens": 2})[0] == 200


def test_rpc_slots_cover_http_requests(engine_dir: Path) -> None:
    with running_server(engine_dir, triton_http_port=0, max_concurrent_rpcs=1) as srv:
        url = f"127.0.0.1:{srv.server.triton_http_port}"
        with srv.paced() as paced:
            paced.hold()
            held = Events(url, "ensemble", {"text_input": "Hi", "max_tokens": 500, "stream": True})
            try:
                _first_token(srv, paced)
                assert held.next() is not None  # generating, holding the one slot, and cannot finish
                assert error_of(post(url, "/v2/models/ensemble/generate", {"text_input": "Hi", "max_tokens": 2})) == (
                    429, "too many RPCs in flight (limit 1); retry later")  # fmt: skip
                assert get(url, "/v2/health/ready")[0] == 200  # health takes no slot
            finally:
                held.close()
        assert srv.idle()


def test_a_client_that_disconnects_aborts_its_request(server: ServerThread, url: str) -> None:
    def cancelled() -> float:
        try:
            return server.metric("llm_triton_requests_total", 'code="CANCELLED",model="ensemble"')
        except KeyError:
            return 0.0

    before = cancelled()
    with server.paced() as paced:
        paced.hold()
        s = Events(url, "ensemble", {"text_input": "Hi", "max_tokens": 990, "stream": True})
        _first_token(server, paced)
        assert s.next() is not None and server.server.backend.num_in_flight == 1  # it cannot finish on its own
        s.close()
        wait_until(lambda: cancelled() == before + 1, "the handler ended as CANCELLED")
    assert server.idle()  # aborted in the engine: every block back


def test_drain_lets_http_streams_finish_and_closes_the_port(engine_dir: Path) -> None:
    srv = ServerThread(make_config(engine_dir, triton_http_port=0)).start()
    url = f"127.0.0.1:{srv.server.triton_http_port}"
    idle = http.client.HTTPConnection(url, timeout=30)  # a keep-alive connection, used once, then left open
    try:
        idle.request("GET", "/v2/health/ready")
        assert idle.getresponse().read() == b""
        with srv.paced() as paced:
            paced.hold()
            busy = Events(url, "ensemble", {"id": "d", "text_input": "Hi", "max_tokens": 200, "stream": True,
                                            "return_num_output_tokens": True})  # fmt: skip
            _first_token(srv, paced)
            first = busy.next()  # in flight, and held, while the drain starts
            started = time.monotonic()
            drained = threading.Thread(target=srv.run, args=(srv.server.drain_and_stop(30),))
            drained.start()
            wait_until(lambda: _refused(url), "the listener closed")  # at the start of the drain
            assert drained.is_alive()  # the request in flight holds the drain
            paced.release()
            rest = busy.all()
        events = [first, *rest]
        assert all(e["id"] == "d" and "error" not in e for e in events)
        assert sum(e["num_output_tokens"] for e in events) == 200  # finished, every token sent
        drained.join(30)
        assert not drained.is_alive() and time.monotonic() - started < 15  # not held to its 30 s by the idle one
    finally:
        idle.close()
        srv.stop()


def test_the_drain_timeout_ends_a_stream_with_an_error_event(engine_dir: Path) -> None:
    """A request still running at the drain's cut: its stream has sent events (status 200), so its end is an
    `{"error": ...}` event, as Triton's generate_stream reports a late error."""
    srv = ServerThread(make_config(engine_dir, triton_http_port=0)).start()
    url = f"127.0.0.1:{srv.server.triton_http_port}"
    try:
        with srv.paced(min_step_s=0.01):  # 990 tokens take 10 s at least: a 0.5 s drain cuts it on any machine
            s = Events(url, "ensemble", {"text_input": "Hi", "max_tokens": 990, "stream": True})
            events = [s.next()]
            drained = threading.Thread(target=srv.run, args=(srv.server.drain_and_stop(0.5),))
            drained.start()
            events += s.all()
            s.close()
            drained.join(30)
    finally:
        srv.stop()
    assert all("text_output" in e for e in events[:-1])
    assert "the server shut down before the request finished after" in events[-1]["error"]


def test_a_busy_http_port_is_named_with_its_flag(engine_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        srv = ServerThread(make_config(engine_dir, triton_http_port=busy.getsockname()[1]))
        try:
            with pytest.raises(OSError, match="--triton-http-port / LLM_TRITON_HTTP_PORT"):
                srv.start()
        finally:
            srv.stop()


def _first_token(srv: ServerThread, paced) -> None:
    """Held: step the engine until its one request has a token (its first event is on its way)."""
    reqs = srv.core.scheduler.requests
    paced.step_until(lambda: len(reqs) == 1 and all(r.output_token_ids for r in reqs.values()))


def _refused(url: str) -> bool:
    try:
        get(url, "/v2/health/live")
    except ConnectionRefusedError:
        return True
    return False


def test_docs_describe_the_http_door() -> None:
    root = Path(__file__).resolve().parent.parent
    api, triton = (root / "docs" / "api.md").read_text(), (root / "docs" / "triton.md").read_text()
    for route in ("/v2/health/live", "/v2/models/{m}/infer", "/generate_stream", "Inference-Header-Content-Length"):
        assert route in api, route
    assert "--triton-http-port" in api and "8002" in api and "http_library_bench" in triton
