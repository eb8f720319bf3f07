"""The Triton door's guided-decoding inputs (guided_decoding_guide_type / guided_decoding_guide, 1.2-era names and
types) -> the Constraint the backend gets (service/api/triton/guided.py).

The mapping is a pure function, tested on its own; then through the real door (gRPC stream, unary ModelInfer and
HTTP generate) with the backend's generate wrapped to record the Constraint that reaches it. Whether the engine
enforces it is the backend's business (native: llguidance; trtllm: xgrammar), not tested here. Only the tests
that start servers are marked `server`: the mapping's own run in a quick unit run.
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tritonclient.grpc as tg

from build_engine.triton_models.tables import MODELS
from service.api.triton.convert import to_call
from service.api.triton.guided import GUIDE_KINDS, guided_constraint
from service.errors import InvalidRequest
from service.request import MAX_CONSTRAINT_CHARS, Constraint
from tests.engines import build_tiny
from tests.servers import ServerThread, running_server
from tests.triton_clients import inputs, stream_once

SCHEMA = '{"type": "object", "properties": {"n": {"type": "integer"}}}'
INFO = SimpleNamespace(vocab_size=100, eos_token_ids=(2,))


# ---- the pure mapping --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("guide_type", "guide", "expected"),
    [
        (None, None, None),
        ("json", None, Constraint("json_object")),
        ("json", "", Constraint("json_object")),  # an empty guide is no guide
        ("json_schema", SCHEMA, Constraint("json_schema", SCHEMA)),
        ("regex", r"\d+", Constraint("regex", r"\d+")),
        ("ebnf_grammar", "root ::= [0-9]+", Constraint("gbnf", "root ::= [0-9]+")),
        ("structural_tag", '{"type": "structural_tag"}', Constraint("structural_tag", '{"type": "structural_tag"}')),
    ],
)
def test_guide_types_map_onto_constraints(guide_type, guide, expected) -> None:
    assert guided_constraint(guide_type, guide) == expected


def test_the_guide_types_are_tensorrt_llms() -> None:
    # utils.cc's guideTypeMapping (json, json_schema, regex, ebnf_grammar) and GuideType.STRUCTURAL_TAG
    assert sorted(GUIDE_KINDS) == ["ebnf_grammar", "json", "json_schema", "regex", "structural_tag"]


@pytest.mark.parametrize(
    ("guide_type", "guide", "names", "why"),
    [
        (None, "{}", "'guided_decoding_guide'", "needs 'guided_decoding_guide_type'"),
        ("lark", "start: x", "'guided_decoding_guide_type'", "must be one of json, json_schema"),
        ("JSON", None, "'guided_decoding_guide_type'", "must be one of"),  # as TensorRT-LLM: lower case only
        ("regex", None, "'guided_decoding_guide'", "is required with guided_decoding_guide_type 'regex'"),
        ("ebnf_grammar", "", "'guided_decoding_guide'", "is required"),
        ("json", SCHEMA, "'guided_decoding_guide'", "not used with guided_decoding_guide_type 'json'"),
        ("json_schema", "{not json", "'guided_decoding_guide'", "is not valid JSON"),
        ("structural_tag", "[", "'guided_decoding_guide'", "is not valid JSON"),
        ("regex", "a" * (MAX_CONSTRAINT_CHARS + 1), "'guided_decoding_guide'", "characters, more than"),
    ],
)
def test_refusals_name_the_input(guide_type, guide, names, why) -> None:
    with pytest.raises(InvalidRequest) as exc:
        guided_constraint(guide_type, guide)
    assert names in str(exc.value) and why in str(exc.value), str(exc.value)


def _tensors(model: str, **values) -> dict[str, np.ndarray]:
    out = {}
    for name, value in values.items():
        spec = MODELS[model].input(name)
        if spec.datatype == "BYTES":
            items = value if isinstance(value, list) else [value]
            out[name] = np.array([[v.encode() for v in items]], dtype=np.object_)
        else:
            out[name] = np.array(value, dtype={"INT32": np.int32, "BOOL": np.bool_}[spec.datatype]).reshape(1, -1)
    return out


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm"])
def test_to_call_puts_the_constraint_on_the_sampling(model: str) -> None:
    base = (
        {"text_input": "hi", "max_tokens": 4}
        if model == "ensemble"
        else {"input_ids": [5, 6], "input_lengths": 2, "request_output_len": 4}
    )
    guided = {"guided_decoding_guide_type": "regex", "guided_decoding_guide": "[ab]+"}
    call = to_call(MODELS[model], "r", _tensors(model, **base, **guided), [], INFO)
    assert call.sampling.constraint == Constraint("regex", "[ab]+")
    plain = to_call(MODELS[model], "r", _tensors(model, **base), [], INFO)
    assert plain.sampling.constraint is None
    two = {"guided_decoding_guide_type": ["regex", "json"], "guided_decoding_guide": "[ab]+"}
    with pytest.raises(InvalidRequest, match="'guided_decoding_guide_type' must hold one string, got 2"):
        to_call(MODELS[model], "r", _tensors(model, **base, **two), [], INFO)


def test_the_tables_declare_the_inputs_as_the_1_2_configs_do() -> None:
    for model in ("ensemble", "tensorrt_llm"):
        for name in ("guided_decoding_guide_type", "guided_decoding_guide"):
            t = MODELS[model].input(name)
            assert (t.datatype, t.dims, t.optional, t.ragged, t.scalar, t.served) == ("BYTES", (1,), True, True,
                                                                                     False, True), (model, name)  # fmt: skip
    (llm_step,) = [s for s in MODELS["ensemble"].steps if s.model == "tensorrt_llm"]
    assert llm_step.input_map["guided_decoding_guide_type"] == "guided_decoding_guide_type"  # the ensemble passes them
    assert llm_step.input_map["guided_decoding_guide"] == "guided_decoding_guide"


# ---- through the door: what reaches the backend ------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    engine_dir: Path = build_tiny(tmp_path_factory, "tiny-triton-guided", max_batch_size=8, max_num_tokens=64,
                                  max_seq_len=512)  # fmt: skip
    with running_server(engine_dir, triton_port=0, triton_http_port=0) as s:
        yield s


@pytest.fixture
def seen(server: ServerThread, monkeypatch) -> list:
    """The constraints of the requests the backend gets."""
    backend = server.server.backend
    got: list = []
    original = backend.generate

    def recording(gen, *args, **kwargs):
        got.append(gen.sampling.constraint)
        return original(gen, *args, **kwargs)

    monkeypatch.setattr(backend, "generate", recording)
    return got


def _grpc(server: ServerThread) -> str:
    return f"127.0.0.1:{server.server.triton_port}"


@pytest.mark.server
def test_the_stream_door_sends_the_constraint(server: ServerThread, seen: list) -> None:
    url = _grpc(server)
    guided = {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": SCHEMA}
    run = stream_once(url, "ensemble", inputs("ensemble", text_input="hi", max_tokens=3, stream=True, **guided))
    assert not run.errors, run.errors
    run = stream_once(url, "tensorrt_llm", inputs("tensorrt_llm", input_ids=[5, 6], input_lengths=2,
                      request_output_len=3, streaming=True, guided_decoding_guide_type="ebnf_grammar",
                      guided_decoding_guide='root ::= "a"'))  # fmt: skip
    assert not run.errors, run.errors
    run = stream_once(url, "ensemble", inputs("ensemble", text_input="hi", max_tokens=3, stream=True))
    assert not run.errors, run.errors
    assert seen == [Constraint("json_schema", SCHEMA), Constraint("gbnf", 'root ::= "a"'), None]


@pytest.mark.server
def test_unary_infer_sends_the_constraint_and_refuses_by_name(server: ServerThread, seen: list) -> None:
    client = tg.InferenceServerClient(_grpc(server))
    try:
        client.infer(
            "ensemble_sync", inputs("ensemble", text_input="hi", max_tokens=3, guided_decoding_guide_type="json")
        )
        with pytest.raises(Exception) as exc:
            client.infer("ensemble_sync", inputs("ensemble", text_input="hi", max_tokens=3,
                                                 guided_decoding_guide_type="grammar"))  # fmt: skip
    finally:
        client.close()
    assert "StatusCode.INVALID_ARGUMENT" in str(exc.value) and "'guided_decoding_guide_type'" in str(exc.value)
    assert seen == [Constraint("json_object")]  # the refused one never reached the backend


@pytest.mark.server
def test_http_generate_sends_the_constraint(server: ServerThread, seen: list) -> None:
    body = {
        "text_input": "hi",
        "max_tokens": 3,
        "guided_decoding_guide_type": "regex",
        "guided_decoding_guide": "[0-9]+",
    }
    conn = http.client.HTTPConnection(f"127.0.0.1:{server.server.triton_http_port}", timeout=60)
    try:
        conn.request("POST", "/v2/models/ensemble/generate", json.dumps(body).encode())
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        resp.read()
        conn.request("POST", "/v2/models/ensemble/generate", json.dumps({**body, "guided_decoding_guide": ""}).encode())
        bad = conn.getresponse()
        status, error = bad.status, json.loads(bad.read())["error"]
    finally:
        conn.close()
    assert status == 400 and "'guided_decoding_guide' is required" in error, error
    assert seen == [Constraint("regex", "[0-9]+")]


# ---- the triton backend: a constraint sent to a Triton server as these inputs -------------------------------------
def _sent(constraint: Constraint) -> dict[str, str]:
    from service.backends.triton_io import guided_inputs

    out = {}
    for t in guided_inputs(constraint):
        assert t.datatype() == "BYTES" and t.shape() == [1, 1], t.name()
        out[t.name()] = t._raw_content[4:].decode()  # one BYTES element: 4-byte length, then its bytes
    return out


@pytest.mark.parametrize(
    ("constraint", "back"),
    [
        (Constraint("json_object"), Constraint("json_object")),
        (Constraint("json_schema", SCHEMA), Constraint("json_schema", SCHEMA)),
        (Constraint("regex", "[ab]+"), Constraint("regex", "[ab]+")),
        (Constraint("gbnf", 'root ::= "a"'), Constraint("gbnf", 'root ::= "a"')),
        (Constraint("choice", choices=("yes", "no")), Constraint("gbnf", 'root ::= "yes" | "no"')),
    ],
)
def test_the_triton_backend_sends_what_the_door_reads_back(constraint: Constraint, back: Constraint) -> None:
    sent = _sent(constraint)
    assert set(sent) <= {"guided_decoding_guide_type", "guided_decoding_guide"}
    assert guided_constraint(sent["guided_decoding_guide_type"], sent.get("guided_decoding_guide")) == back


@pytest.mark.parametrize(
    ("constraint", "why"),
    [
        (Constraint("lark", 'start: "a"'), "not Lark"),
        (Constraint("structural_tag", "{}"), "maps no such guided_decoding_guide_type"),  # utils.cc would ignore it
        (Constraint("json_object", any_whitespace=False), "any_whitespace"),
    ],
)
def test_the_triton_backend_refuses_what_a_triton_server_cannot_take(constraint: Constraint, why: str) -> None:
    with pytest.raises(InvalidRequest, match=why):
        _sent(constraint)


@pytest.mark.server
def test_a_constraint_crosses_the_chain(server: ServerThread) -> None:
    """B (--backend triton, both Triton models) -> A's Triton door -> the Constraint A's backend gets."""
    import asyncio

    from service.request import GenerateRequest, SamplingParams

    got: list = []
    backend = server.server.backend
    original = backend.generate

    def recording(gen, *args, **kwargs):
        got.append(gen.sampling.constraint)
        return original(gen, *args, **kwargs)

    backend.generate = recording
    engine_dir = Path(server.server.cfg.backend.engine_dir)
    try:
        for model in ("tensorrt_llm", "ensemble"):
            kw = {"backend_name": "triton", "backend.triton.url": _grpc(server), "backend.triton.model": model}
            with running_server(engine_dir, **kw) as b:
                prompt = b.server.backend.tokenizer.encode("hi")

                async def go(b=b, prompt=prompt) -> list:
                    sampling = SamplingParams(max_tokens=3, constraint=Constraint("choice", choices=("yes", "no")))
                    return [o async for o in b.server.backend.generate(GenerateRequest("x", prompt, sampling))]

                outs = asyncio.run_coroutine_threadsafe(go(), b.loop).result(60)
                assert outs[-1].finished and outs[-1].finish_reason != "error", outs
    finally:
        del backend.generate
    constrained = [c for c in got if c is not None]  # B's warm-up generation at its start is unconstrained
    assert constrained == [Constraint("gbnf", 'root ::= "yes" | "no"')] * 2
