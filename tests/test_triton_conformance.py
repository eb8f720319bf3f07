"""Conformance with NVIDIA's own Triton clients: the requests of the scripts Triton's TensorRT-LLM CI runs
(tensorrtllm_backend v0.18.2 `inflight_batcher_llm/client/` and `tools/inflight_batcher_llm/`; NVIDIA/TensorRT-LLM
`triton_backend/` from v0.19), rebuilt here from reading them (their code is not copied), against the front door
over real gRPC on SmolLM2, with the shapes and dtypes of docs/triton.md's table. Every response is read the way
those scripts read it (`output[0].decode()`, `seq_lens[0][0]`, `output_ids[0][0]`, `batch_index[0][0]`), so a
shape they do not expect fails here as it failed them.

The scripts themselves, run unchanged against the front door: docs/triton.md ("NVIDIA's scripts").
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from build_engine.triton_models.tables import REFUSED
from protos.llm.v1 import llm_pb2
from tests.servers import ServerThread, generate, ids_and_text, running_server
from tests.triton_clients import Streamer, is_final, stream_once

pytestmark = pytest.mark.server

PROMPT = "Born in north-east France, Soyer trained as a"
OUT_LEN = 12


@pytest.fixture(scope="module")
def decoupled(smollm2_engine_dir: Path):
    """The default deployment: ensemble and tensorrt_llm decoupled (the streaming scripts)."""
    with running_server(smollm2_engine_dir, triton_port=0) as s:
        yield s


@pytest.fixture(scope="module")
def unary(smollm2_engine_dir: Path):
    """`--triton-decoupled false`: what NVIDIA's non-streaming tools address (ModelInfer on the canonical names)."""
    with running_server(smollm2_engine_dir, triton_port=0, triton_http_port=0, triton_decoupled=False) as s:
        yield s


def _url(server: ServerThread) -> str:
    return f"127.0.0.1:{server.server.triton_port}"


def _t(name: str, arr: np.ndarray, lib=tg):
    """The scripts' prepare_tensor: the datatype from the numpy array (lib: tritonclient.grpc or .http)."""
    t = lib.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
    t.set_data_from_numpy(arr)
    return t


def _client(server: ServerThread, protocol: str):
    """The tools' create_inference_server_client: tritonclient.grpc on the gRPC port, .http on the HTTP one."""
    if protocol == "http":
        return th, th.InferenceServerClient(f"127.0.0.1:{server.server.triton_http_port}")
    return tg, tg.InferenceServerClient(_url(server))


def _llm_v1(server: ServerThread, prompt: str, max_tokens: int) -> tuple[str, list[int], list[int]]:
    """llm.v1's greedy text and ids for the prompt, and the prompt's ids."""
    req = llm_pb2.GenerateRequest(
        prompt=prompt,
        sampling=llm_pb2.SamplingParams(temperature=0),
        stopping=llm_pb2.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    chunks, _ = generate(server.stub(), req, timeout=120)
    ids, text = ids_and_text(chunks)
    prompt_ids = list(server.stub().Tokenize(llm_pb2.TokenizeRequest(text=prompt)).token_ids)
    return text, ids, prompt_ids


def _decode(server: ServerThread, ids: list[int]) -> str:
    return server.server.backend.tokenizer.decode(ids, skip_special_tokens=True)


# ---- end_to_end_grpc_client.py: the text client -------------------------------------------------------------
def _text_client_inputs(prompt: str, streaming: bool, **extra) -> list[tg.InferInput]:
    """end_to_end_grpc_client.py's prepare_inputs with its defaults (beam 1, temperature 1.0, one sequence, input
    kept in the output, end_id -1 so exactly OUT_LEN tokens come)."""
    values = {
        "text_input": np.array([[prompt]]).astype(object),
        "max_tokens": np.ones((1, 1), np.int32) * OUT_LEN,
        "stream": np.array([[streaming]], dtype=bool),
        "beam_width": np.array([[1]], dtype=np.int32),
        "temperature": np.array([[1.0]], dtype=np.float32),
        "num_return_sequences": np.array([[1]], dtype=np.int32),
        "end_id": np.array([[-1]], dtype=np.int32),
        "exclude_input_in_output": np.array([[False]], dtype=bool),
        **extra,
    }
    return [_t(k, v) for k, v in values.items()]


def test_text_client_streaming_reads_output_0_decode(decoupled: ServerThread) -> None:
    text, _, _ = _llm_v1(decoupled, PROMPT, OUT_LEN)
    run = stream_once(
        _url(decoupled), "ensemble", _text_client_inputs(PROMPT, True), outputs=[tg.InferRequestedOutput("text_output")]
    )
    assert not run.errors
    pieces = []
    for result in run.results:
        output = result.as_numpy("text_output")
        if output is None:  # the empty final response
            continue
        assert output.shape == (1,) and output.dtype == np.object_  # [batch x beams]
        pieces.append(output[0].decode("utf-8"))  # what the client does
    assert "".join(pieces) == text  # greedy (no top_k / top_p: TensorRT-LLM's rule), identical to llm.v1


def test_text_client_unary_returns_prompt_and_output_decoded(decoupled: ServerThread) -> None:
    _, ids, prompt_ids = _llm_v1(decoupled, PROMPT, OUT_LEN)
    run = stream_once(
        _url(decoupled),
        "ensemble",
        _text_client_inputs(PROMPT, False),
        outputs=[tg.InferRequestedOutput("text_output")],
    )
    data = [r for r in run.results if r.as_numpy("text_output") is not None]
    assert not run.errors and len(data) == 1 and is_final(data[0])
    output = data[0].as_numpy("text_output")
    assert output.shape == (1,)
    assert output[0].decode() == _decode(decoupled, prompt_ids + ids)  # what postprocessing decodes


def test_text_client_batch_and_sequence_index(decoupled: ServerThread) -> None:
    """With --batch-inputs / --num-return-sequences the client asks for batch_index and sequence_index and reads
    [0][0]."""
    outputs = [tg.InferRequestedOutput(n) for n in ("text_output", "batch_index", "sequence_index")]
    run = stream_once(_url(decoupled), "ensemble", _text_client_inputs(PROMPT, True), outputs=outputs)
    data = [r for r in run.results if r.as_numpy("text_output") is not None]
    assert data and not run.errors
    for r in data:
        for name in ("batch_index", "sequence_index"):
            value = r.as_numpy(name)
            assert value.shape == (1, 1) and value.dtype == np.int32 and value[0][0] == 0


def test_text_client_log_probs(decoupled: ServerThread) -> None:
    outputs = [tg.InferRequestedOutput(n) for n in ("text_output", "cum_log_probs", "output_log_probs")]
    extra = {"return_log_probs": np.array([[True]], dtype=bool)}
    run = stream_once(_url(decoupled), "ensemble", _text_client_inputs(PROMPT, False, **extra), outputs=outputs)
    (result,) = [r for r in run.results if r.as_numpy("text_output") is not None]
    cum, each = result.as_numpy("cum_log_probs"), result.as_numpy("output_log_probs")
    assert cum.shape == (1, 1) and cum.dtype == np.float32
    assert each.shape == (1, 1, OUT_LEN) and each.dtype == np.float32  # one per generated token
    assert (each <= 0).all() and math.isclose(cum[0][0], each.sum(), rel_tol=1e-4, abs_tol=1e-4)


def test_text_client_refuses_what_it_cannot_honour_by_name(decoupled: ServerThread) -> None:
    """The 0.x client's --return-kv-cache-reuse-stats, embedding bias and LoRA: INVALID_ARGUMENT naming the
    tensor and why, never INTERNAL."""
    cases = {
        "return_kv_cache_reuse_stats": np.array([[True]], dtype=bool),
        "embedding_bias_words": np.array([["foo"]]).astype(object),
        "lora_task_id": np.array([[1]], dtype=np.uint64),
    }
    for name, value in cases.items():
        run = stream_once(_url(decoupled), "ensemble", _text_client_inputs(PROMPT, True, **{name: value}))
        assert len(run.errors) == 1, name
        assert f"'{name}'" in str(run.errors[0]) and "not supported" in str(run.errors[0])


# ---- inflight_batcher_llm_client.py: the token client ---------------------------------------------------------
def _token_client_inputs(prompt_ids: list[int], streaming: bool, end_id: int, lib=tg, **extra) -> list:
    """inflight_batcher_llm_client.py's prepare_inputs with its defaults (beam 1, temperature 1.0, top_k 1,
    top_p 0, one sequence)."""
    values = {
        "input_ids": np.array([prompt_ids], dtype=np.int32),
        "input_lengths": np.array([[len(prompt_ids)]], dtype=np.int32),
        "request_output_len": np.array([[OUT_LEN]], dtype=np.int32),
        "beam_width": np.array([[1]], dtype=np.int32),
        "temperature": np.array([[1.0]], dtype=np.float32),
        "streaming": np.array([[streaming]], dtype=bool),
        "end_id": np.array([[end_id]], dtype=np.int32),
        "pad_id": np.array([[end_id]], dtype=np.int32),
        "runtime_top_k": np.array([[1]], dtype=np.int32),
        "runtime_top_p": np.array([[0.0]], dtype=np.float32),
        "num_return_sequences": np.array([[1]], dtype=np.int32),
        **extra,
    }
    return [_t(k, v, lib) for k, v in values.items()]


def _check_ids(result, n: int | None = None) -> list[int]:
    """output_ids [1, 1, n] INT32 and sequence_length [1, 1] INT32, read as the client reads them."""
    ids, lens = result.as_numpy("output_ids"), result.as_numpy("sequence_length")
    assert ids.dtype == np.int32 and ids.ndim == 3 and ids.shape[:2] == (1, 1)
    assert lens.dtype == np.int32 and lens.shape == (1, 1) and lens[0][0] == ids.shape[2]
    if n is not None:
        assert ids.shape[2] == n
    return list(ids[0][0])


def test_token_client_streaming(decoupled: ServerThread) -> None:
    _, ids, prompt_ids = _llm_v1(decoupled, PROMPT, OUT_LEN)
    run = stream_once(_url(decoupled), "tensorrt_llm", _token_client_inputs(prompt_ids, True, end_id=-1))
    assert not run.errors
    got = [t for r in run.results if r.get_output("output_ids") is not None for t in _check_ids(r)]
    assert got == ids  # streaming: only the new tokens, token-identical to llm.v1


def test_token_client_stop_after_ms_sends_a_stop_request(decoupled: ServerThread) -> None:
    """--stop-after-ms: the client sends a second request with the same id and `stop` true on the stream; the
    first request ends with a final response and no error."""
    _, _, prompt_ids = _llm_v1(decoupled, PROMPT, 1)
    s = Streamer(_url(decoupled))
    try:
        long = _token_client_inputs(prompt_ids, True, end_id=-1)
        long[2] = _t("request_output_len", np.array([[2000]], dtype=np.int32))
        s.send("tensorrt_llm", long, request_id="7")
        first = s.queue.get(timeout=120)  # a token came: the request is running
        assert first[1] is None
        stop = [
            _t("input_ids", np.array([[0]], dtype=np.int32)),
            _t("input_lengths", np.array([[1]], dtype=np.int32)),
            _t("request_output_len", np.array([[1]], dtype=np.int32)),
            _t("stop", np.array([[True]], dtype=bool)),
        ]
        s.send("tensorrt_llm", stop, request_id="7")
        run = s.read(n_final=2)
        assert not run.errors
        ended = [r for r in run.results if is_final(r) and r.get_response().id == "7"]
        assert ended, "the stopped request got its final response"
    finally:
        s.close()
    assert decoupled.idle(), "the stopped request ended in the engine"


def test_token_client_stop_via_request_cancel(decoupled: ServerThread) -> None:
    """--stop-via-request-cancel: stop_stream(cancel_requests=True) aborts the request in the engine."""
    _, _, prompt_ids = _llm_v1(decoupled, PROMPT, 1)
    s = Streamer(_url(decoupled))
    inputs = _token_client_inputs(prompt_ids, True, end_id=-1)
    inputs[2] = _t("request_output_len", np.array([[2000]], dtype=np.int32))
    s.send("tensorrt_llm", inputs, request_id="8")
    assert s.queue.get(timeout=120)[1] is None
    s.client.stop_stream(cancel_requests=True)
    s.client.close()
    assert decoupled.idle(), "the cancelled request ended in the engine"


def test_token_client_unary_modes(unary: ServerThread) -> None:
    """Non-streaming against `tensorrt_llm` with --triton-decoupled false: prompt + output ids, or only the
    output with --exclude-input-in-output; --return-log-probs; --return-perf-metrics (the 1.x client)."""
    _, ids, prompt_ids = _llm_v1(unary, PROMPT, OUT_LEN)
    client = tg.InferenceServerClient(_url(unary))
    eos = unary.server.backend.info.eos_token_ids[0]
    try:
        full = client.infer("tensorrt_llm", _token_client_inputs(prompt_ids, False, end_id=-1))
        assert _check_ids(full) == prompt_ids + ids
        excl = {"exclude_input_in_output": np.array([[True]], dtype=bool)}
        assert _check_ids(client.infer("tensorrt_llm", _token_client_inputs(prompt_ids, False, -1, **excl))) == ids
        lp = client.infer(
            "tensorrt_llm",
            _token_client_inputs(prompt_ids, False, -1, return_log_probs=np.array([[True]], dtype=bool)),
        )
        assert lp.as_numpy("cum_log_probs").shape == (1, 1)
        assert lp.as_numpy("output_log_probs").shape == (1, 1, OUT_LEN)
        perf = client.infer(
            "tensorrt_llm",
            _token_client_inputs(prompt_ids, False, eos, return_perf_metrics=np.array([[True]], dtype=bool)),
        )
        new, reused, total = (
            int(perf.as_numpy(n)[0][0])
            for n in ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks")
        )
        assert total == new + reused and total >= 1
        assert perf.as_numpy("acceptance_rate").shape == (1, 1) and perf.as_numpy("total_draft_tokens")[0][0] == 0
        times = [int(perf.as_numpy(n)[0][0]) for n in ("arrival_time_ns", "first_token_time_ns", "last_token_time_ns")]
        assert times == sorted(times) and times[0] > 0
        with pytest.raises(InferenceServerException, match="Streaming is only supported in decoupled mode"):
            client.infer("tensorrt_llm", _token_client_inputs(prompt_ids, True, end_id=-1))
    finally:
        client.close()


def test_decoupled_canonical_models_refuse_model_infer(decoupled: ServerThread) -> None:
    client = tg.InferenceServerClient(_url(decoupled))
    try:
        with pytest.raises(InferenceServerException, match="doesn't support models with decoupled") as err:
            client.infer("tensorrt_llm", _token_client_inputs([1, 2, 3], False, end_id=-1))
        assert err.value.status() == "StatusCode.UNIMPLEMENTED"
        assert client.get_model_config("tensorrt_llm").config.model_transaction_policy.decoupled
    finally:
        client.close()


def test_unary_deployment_says_so_in_its_config(unary: ServerThread) -> None:
    client = tg.InferenceServerClient(_url(unary))
    try:
        for name in ("ensemble", "tensorrt_llm"):
            assert not client.get_model_config(name).config.model_transaction_policy.decoupled
    finally:
        client.close()


# ---- end_to_end_test.py: the steps chained by hand == the ensemble -------------------------------------------
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_end_to_end_steps_by_hand_equal_the_ensemble(unary: ServerThread, protocol: str) -> None:
    lib, client = _client(unary, protocol)
    empty_words = np.array([[""]], dtype=object)
    try:
        pre = client.infer(
            "preprocessing",
            [
                _t("QUERY", np.array([[PROMPT]]).astype(object), lib),
                _t("BAD_WORDS_DICT", empty_words, lib),
                _t("STOP_WORDS_DICT", empty_words, lib),
                _t("REQUEST_OUTPUT_LEN", np.ones((1, 1), np.int32) * OUT_LEN, lib),
            ],
            request_id="0",
        )
        input_id, input_len = pre.as_numpy("INPUT_ID"), pre.as_numpy("REQUEST_INPUT_LEN")
        assert input_id.dtype == np.int32 and input_id.shape == (1, int(input_len[0][0]))
        assert pre.as_numpy("DECODER_INPUT_ID").shape == (1, 1)
        assert pre.as_numpy("STOP_WORDS_IDS").shape[:2] == (1, 2)
        llm = client.infer(
            "tensorrt_llm",
            [
                _t("input_ids", input_id, lib),
                _t("decoder_input_ids", pre.as_numpy("DECODER_INPUT_ID"), lib),
                _t("input_lengths", input_len, lib),
                _t("request_output_len", pre.as_numpy("REQUEST_OUTPUT_LEN"), lib),
                _t("end_id", pre.as_numpy("OUT_END_ID"), lib),
                _t("pad_id", pre.as_numpy("OUT_PAD_ID"), lib),
                _t("return_log_probs", np.array([[True]], dtype=bool), lib),
            ],
            request_id="0",
        )
        post = client.infer(
            "postprocessing",
            [
                _t("TOKENS_BATCH", llm.as_numpy("output_ids"), lib),
                _t("SEQUENCE_LENGTH", llm.as_numpy("sequence_length"), lib),
            ],
            request_id="0",
        )
        ens = client.infer(
            "ensemble",
            [
                _t("text_input", np.array([[PROMPT]]).astype(object), lib),
                _t("max_tokens", np.ones((1, 1), np.int32) * OUT_LEN, lib),
                _t("bad_words", empty_words, lib),
                _t("stop_words", empty_words, lib),
                _t("return_log_probs", np.array([[True]], dtype=bool), lib),
            ],
            outputs=[lib.InferRequestedOutput(n) for n in ("text_output", "cum_log_probs", "output_log_probs")],
            request_id="0",
        )
        assert post.as_numpy("OUTPUT").shape == (1,) and ens.as_numpy("text_output").shape == (1,)
        assert post.as_numpy("OUTPUT") == ens.as_numpy("text_output")  # the script's own assertion
        assert ens.as_numpy("cum_log_probs") == llm.as_numpy("cum_log_probs")
        assert (ens.as_numpy("output_log_probs") == llm.as_numpy("output_log_probs")).all()
    finally:
        client.close()


def test_step_models_refuse_bad_input_by_name(unary: ServerThread) -> None:
    client = tg.InferenceServerClient(_url(unary))
    vocab = unary.server.backend.info.vocab_size
    try:
        bad = {
            "TOKENS_BATCH": [_t("TOKENS_BATCH", np.array([[[vocab + 5]]], dtype=np.int32))],
            "SEQUENCE_LENGTH": [
                _t("TOKENS_BATCH", np.array([[[1, 2]]], dtype=np.int32)),
                _t("SEQUENCE_LENGTH", np.array([[3]], dtype=np.int32)),
            ],
            "the model's context": [  # more ids than any request can hold: refused before decoding
                _t("TOKENS_BATCH", np.ones((1, 2, unary.server.backend.info.max_seq_len), dtype=np.int32)),
            ],
        }
        for name, tensors in bad.items():
            with pytest.raises(InferenceServerException, match=name) as err:
                client.infer("postprocessing", tensors)
            assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
        with pytest.raises(InferenceServerException, match="IMAGE_URL") as err:
            client.infer(
                "preprocessing",
                [
                    _t("QUERY", np.array([["hi"]]).astype(object)),
                    _t("REQUEST_OUTPUT_LEN", np.ones((1, 1), np.int32)),
                    _t("IMAGE_URL", np.array([["http://x"]]).astype(object)),
                ],
            )
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    finally:
        client.close()


# ---- benchmark_core_model.py dataset mode: token ids to tensorrt_llm, concurrently -----------------------------
def test_benchmark_core_model_dataset_requests(unary: ServerThread, decoupled: ServerThread) -> None:
    """Its dataset mode sends each prompt's ids with end_id / pad_id from the tokenizer and reads
    outputs[0]['shape'][2] (output_ids first, three dims) from the JSON form of each response, over gRPC
    (ModelInfer, or a stream with --decoupled) and HTTP."""
    prompts = ["The capital of France is", "Write one sentence about the sea.", "List three colors:"]
    tok = unary.server.backend.tokenizer
    eos = unary.server.backend.info.eos_token_ids[0]
    for way in ("grpc", "http", "grpc-decoupled"):
        for prompt in prompts:
            ids = tok.encode(prompt)
            if way == "grpc-decoupled":
                run = stream_once(_url(decoupled), "tensorrt_llm", _token_client_inputs(ids, False, end_id=eos))
                results = [r for r in run.results if r.get_output("output_ids") is not None]
                assert not run.errors and len(results) == 1
                result, first = results[0], results[0].get_response(as_json=True)["outputs"][0]
            else:
                lib, client = _client(unary, way)
                try:
                    result = client.infer("tensorrt_llm", _token_client_inputs(ids, False, end_id=eos, lib=lib))
                finally:
                    client.close()
                response = result.get_response(as_json=True) if way == "grpc" else result.get_response()
                first = response["outputs"][0]
            assert first["name"] == "output_ids" and len(first["shape"]) == 3, way
            _check_ids(result)


# ---- fuzz: no combination of the 1.2 tensors reaches INTERNAL ----------------------------------------------------
_NP = {"BOOL": np.bool_, "INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64, "FP32": np.float32,
       "FP16": np.float16, "UINT8": np.uint8, "BYTES": np.object_}  # fmt: skip
_EDGE_INTS = (-1, 0, 1, 2, 7, 2**31 - 1, -(2**31))
_EDGE_FLOATS = (0.0, 0.5, 1.0, -1.0, 1e9, float("nan"), float("inf"))
_EDGE_BYTES = (b"", b"hi", b"\xff\xfe", "h\u00e9llo".encode(), b"x" * 300)


def _fuzz_value(rng: np.random.Generator, datatype: str, shape: list[int]) -> np.ndarray:
    n = int(np.prod(shape))
    if datatype == "BYTES":
        flat = np.array([_EDGE_BYTES[rng.integers(len(_EDGE_BYTES))] for _ in range(n)], dtype=np.object_)
    elif datatype == "BOOL":
        flat = rng.integers(0, 2, n).astype(bool)
    elif datatype in ("FP32", "FP16"):
        flat = np.array([_EDGE_FLOATS[rng.integers(len(_EDGE_FLOATS))] for _ in range(n)], dtype=_NP[datatype])
    else:
        values = [_EDGE_INTS[rng.integers(len(_EDGE_INTS))] for _ in range(n)]
        info = np.iinfo(_NP[datatype])
        flat = np.array([min(max(v, info.min), info.max) for v in values], dtype=_NP[datatype])
    return flat.reshape(shape)


def _fuzz_request(rng: np.random.Generator, spec) -> list[tg.InferInput]:
    names = [(t.name, t.datatype, t.dims) for t in spec.inputs]
    names += [(name, "INT32", (1,)) for name in REFUSED.get(spec.kind, {})]
    tensors = []
    for name, declared, dims in names:
        if not any(t.name == name and not t.optional for t in spec.inputs) and rng.random() > 0.3:
            continue
        datatype = declared if rng.random() >= 0.1 else ("INT32", "FP32", "BYTES", "BOOL", "INT64")[rng.integers(5)]
        shape = [1, *(int(rng.integers(0, 4)) if d == -1 else d for d in dims)]
        if rng.random() < 0.1:
            shape = [int(rng.integers(0, 3)) for _ in range(int(rng.integers(1, 4)))]
        tensors.append(_t(name, _fuzz_value(rng, datatype, shape)))
    return tensors


def test_fuzzed_requests_never_reach_internal(unary: ServerThread) -> None:
    specs = unary.server.triton_servicer.inference.models.specs
    rng = np.random.default_rng(17)
    client = tg.InferenceServerClient(_url(unary))
    codes: dict[str, int] = {}
    try:
        for i in range(400):
            spec = list(specs.values())[i % len(specs)]
            if spec.decoupled:
                continue
            try:
                client.infer(spec.name, _fuzz_request(rng, spec), client_timeout=120)
                codes["OK"] = codes.get("OK", 0) + 1
            except InferenceServerException as exc:
                code = exc.status() or "?"
                assert code not in ("StatusCode.INTERNAL", "StatusCode.UNKNOWN"), (spec.name, exc.message())
                codes[code] = codes.get(code, 0) + 1
        health = client.is_server_ready()
    finally:
        client.close()
    assert health and unary.idle()  # nothing hurt the engine; every KV block came back
    assert codes.get("StatusCode.INVALID_ARGUMENT", 0) > 50 and codes.get("OK", 0) > 10, codes
