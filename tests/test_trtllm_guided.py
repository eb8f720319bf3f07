"""Structured output on the TensorRT-LLM backend (service/backends/trtllm_guided.py) against the test double.

What is checked: the executor's GuidedDecodingConfig (xgrammar, the engine's vocabulary, tokenizer text and EOS
ids), the GuidedDecodingParams each constraint kind becomes, the refusals (lark, any_whitespace=false), that an
unconstrained request is sent as before, and that the constraint reaches the engine under the double. What
cannot be checked here: xgrammar enforcing it inside a real executor (tests/test_trtllm_gpu.py, on a GPU).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from build_engine import spec
from build_engine.builder import build
from build_engine.trtllm_builder import TrtllmOptions
from build_engine.xgrammar_info import XgrammarTokenizerInfo, encoded_vocab, tokenizer_info
from service.backends.trtllm import TrtllmBackend
from service.backends.trtllm_guided import SUPPORTED_KINDS, choice_grammar, guided_decoding_params
from service.config import BackendConfig
from service.errors import InvalidRequest
from service.request import Constraint, GenerateRequest, SamplingParams
from tests.trtllm_double import installed
from tests.trtllm_double.executor import GUIDE_KINDS
from tests.waiting import wait_until

pytestmark = pytest.mark.server

LIMITS = {"max_seq_len": 512, "max_num_tokens": 64, "max_batch_size": 8, "kv_block_size": 16}
EXECUTOR = "tensorrt_llm.bindings.executor"
SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
# kind -> (the constraint, the GuideType member, the guide sent)
CASES = {
    "json_object": (Constraint("json_object"), "JSON", None),
    "json_schema": (Constraint("json_schema", SCHEMA), "JSON_SCHEMA", SCHEMA),
    "regex": (Constraint("regex", r"\d{3}-[a-z]+"), "REGEX", r"\d{3}-[a-z]+"),
    "gbnf": (Constraint("gbnf", 'root ::= "a" [0-9]+'), "EBNF_GRAMMAR", 'root ::= "a" [0-9]+'),
    "choice": (Constraint("choice", choices=("yes", "no")), "EBNF_GRAMMAR", 'root ::= "yes" | "no"'),
    "structural_tag": (Constraint("structural_tag", '{"type": "structural_tag"}'), "STRUCTURAL_TAG",
                       '{"type": "structural_tag"}'),
}  # fmt: skip


@pytest.fixture(scope="module")
def double():
    with installed() as d:
        yield d


@pytest.fixture(scope="module")
def engine(double, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trtllm-guided") / "tiny-fp16"
    build("tiny-random", out, LIMITS, progress=False, backend="trtllm", trtllm=TrtllmOptions(dtype="float16"))
    return out


@pytest.fixture
def backend(double, engine: Path):
    b = TrtllmBackend(BackendConfig(engine_dir=str(engine)))
    yield b
    b.executor.shutdown()


def test_the_executor_guides_on_xgrammar_with_the_engines_tokenizer(double, backend: TrtllmBackend) -> None:
    ex = double.executor
    cfg = backend.executor.executor_config.guided_decoding_config
    assert cfg.backend == ex.GuidedDecodingConfig.GuidedDecodingBackend.XGRAMMAR
    tok = backend.tokenizer
    assert cfg.encoded_vocab == [tok.id_to_token(i) for i in range(tok.vocab_size)]  # token strings in id order
    assert cfg.tokenizer_str == (backend.engine_dir / spec.TOKENIZER_FILE).read_text()
    assert cfg.stop_token_ids == list(backend.config.tokenizer.eos_token_ids) and cfg.stop_token_ids
    called = double.recorder.called(f"{EXECUTOR}.GuidedDecodingConfig")
    assert ("backend", "encoded_vocab", "stop_token_ids", "tokenizer_str") in called  # keywords only, all four


@pytest.mark.parametrize("kind", sorted(CASES))
def test_each_kind_becomes_its_guide_type(double, backend: TrtllmBackend, kind: str) -> None:
    constraint, member, guide = CASES[kind]
    request = backend._request(GenerateRequest("g", [5, 6], SamplingParams(max_tokens=4, constraint=constraint)))
    params = request.guided_decoding_params
    assert params.guide_type == getattr(double.executor.GuidedDecodingParams.GuideType, member)
    assert params.guide == guide
    assert ("guide", "guide_type") in double.recorder.called(f"{EXECUTOR}.GuidedDecodingParams")


def test_every_kind_but_lark_is_mapped() -> None:
    assert sorted(SUPPORTED_KINDS) == sorted(CASES)
    assert set(GUIDE_KINDS.values()) == {"json_object", "json_schema", "regex", "gbnf", "structural_tag"}


def test_an_unconstrained_request_is_sent_as_before(double, backend: TrtllmBackend) -> None:
    double.recorder.clear()
    request = backend._request(GenerateRequest("u", [5, 6], SamplingParams(max_tokens=4)))
    assert request.guided_decoding_params is None
    (keywords,) = double.recorder.called(f"{EXECUTOR}.Request")
    assert "guided_decoding_params" not in keywords  # the keyword is not even passed


def test_choices_are_escaped_literals() -> None:
    choices = ('say "hi"', "back\\slash", "new\nline", "tab\t", "café ☕", "a|b", "x ::= y")
    grammar = choice_grammar(choices)
    assert grammar == (
        'root ::= "say \\"hi\\"" | "back\\\\slash" | "new\\nline" | "tab\\t" | "café ☕" | "a|b" | "x ::= y"'
    )
    literals = grammar.removeprefix("root ::= ").split(" | ")
    assert [json.loads(lit) for lit in literals] == list(choices)  # each literal reads back as its choice


def test_lark_is_refused_naming_the_kind_and_why(double, backend: TrtllmBackend) -> None:
    lark = SamplingParams(max_tokens=4, constraint=Constraint("lark", 'start: "a"'))
    double.recorder.clear()

    async def go() -> None:
        backend.start(lambda healthy: None, lambda reason: None)
        try:
            with pytest.raises(InvalidRequest, match=r"lark.*xgrammar.*GBNF"):
                backend.generate(GenerateRequest("l", [5, 6], lark))
        finally:
            await backend.shutdown(2)

    asyncio.run(go())
    assert not double.recorder.called(f"{EXECUTOR}.Executor.enqueue_request")  # refused before the executor


@pytest.mark.parametrize("kind", ["json_object", "json_schema"])
def test_json_without_free_whitespace_is_refused(double, kind: str) -> None:
    spec_text = SCHEMA if kind == "json_schema" else ""
    with pytest.raises(InvalidRequest, match="any_whitespace"):
        guided_decoding_params(double.executor, Constraint(kind, spec_text, any_whitespace=False))
    # any_whitespace means nothing outside JSON: a regex is taken whatever it says
    assert guided_decoding_params(double.executor, Constraint("regex", "a+", any_whitespace=False)) is not None


def test_the_constraint_reaches_the_engine_under_the_double(double, backend: TrtllmBackend, monkeypatch) -> None:
    core = backend.executor.core
    seen: list = []
    enqueue = core.enqueue

    def recording(gen, *args, **kwargs):
        seen.append(gen.sampling.constraint)
        return enqueue(gen, *args, **kwargs)

    monkeypatch.setattr(core, "enqueue", recording)

    async def go() -> list:
        backend.start(lambda healthy: None, lambda reason: None)
        outs = []
        # structural_tag is left out: the native engine standing in for TensorRT-LLM refuses it (docs/structured.md)
        for constraint, _, _ in (v for k, v in CASES.items() if k != "structural_tag"):
            sampling = SamplingParams(max_tokens=3, temperature=0, constraint=constraint)
            outs.append([o async for o in backend.generate(GenerateRequest("c", [5, 6], sampling))])
        await backend.shutdown(2)
        return outs

    outs = asyncio.run(go())
    assert all(run[-1].finished and run[-1].finish_reason != "error" for run in outs), outs
    assert seen == [
        Constraint("json_object"),
        Constraint("json_schema", SCHEMA),
        Constraint("regex", r"\d{3}-[a-z]+"),
        Constraint("gbnf", 'root ::= "a" [0-9]+'),
        Constraint("gbnf", 'root ::= "yes" | "no"'),  # a choice arrives as its grammar
    ]


def test_the_double_keeps_tensorrt_llms_guided_decoding_rules(double, engine: Path) -> None:
    ex = double.executor
    with pytest.raises(RuntimeError, match="guide string must be provided"):
        ex.GuidedDecodingParams(guide_type=ex.GuidedDecodingParams.GuideType.REGEX)
    ex.GuidedDecodingParams(guide_type=ex.GuidedDecodingParams.GuideType.JSON)  # JSON alone is fine
    llguidance = ex.GuidedDecodingConfig(
        backend=ex.GuidedDecodingConfig.GuidedDecodingBackend.LLGUIDANCE, encoded_vocab=["a"], tokenizer_str="{}",
        stop_token_ids=[0],
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="not supported in C\\+\\+ runtime"):
        ex.Executor(str(engine), ex.ModelType.DECODER_ONLY, ex.ExecutorConfig(guided_decoding_config=llguidance))
    plain = ex.Executor(str(engine), ex.ModelType.DECODER_ONLY, ex.ExecutorConfig())  # no guided decoding
    try:
        params = ex.GuidedDecodingParams(guide_type=ex.GuidedDecodingParams.GuideType.JSON)
        request = ex.Request([5, 6], 3, output_config=ex.OutputConfig(exclude_input_from_output=True),
                             guided_decoding_params=params)  # fmt: skip
        rid = plain.enqueue_request(request)
        responses: list = []
        wait_until(lambda: responses.extend(plain.await_responses(timeout=_ms(50))) or responses, "a response")
        assert responses[0].request_id == rid and responses[0].has_error()
    finally:
        plain.shutdown()


def _ms(n: int):
    import datetime

    return datetime.timedelta(milliseconds=n)


def test_tokenizer_info_is_the_c_plus_plus_backends_file_format(engine: Path) -> None:
    from service.tokenizer import Tokenizer

    info = tokenizer_info(engine, (2, 7))
    assert set(info.as_json()) == {"encoded_vocab", "tokenizer_str", "stop_token_ids"}  # what the C++ backend reads
    tok = Tokenizer.from_engine_dir(engine)
    assert list(info.encoded_vocab) == [tok.id_to_token(i) for i in range(tok.vocab_size)]
    assert info.stop_token_ids == (2, 7) and json.loads(info.tokenizer_str)  # tokenizer.json's text


def test_a_gap_in_the_vocabulary_keeps_every_token_on_its_id() -> None:
    class Vocab:
        @staticmethod
        def get_vocab(with_added_tokens: bool) -> dict:
            assert with_added_tokens
            return {"a": 0, "b": 1, "<added>": 3}

    assert encoded_vocab(Vocab()) == ("a", "b", "", "<added>")  # sorted-and-listed would put <added> on id 2
    info = XgrammarTokenizerInfo(("a",), "{}", (0,))
    assert info.as_json() == {"encoded_vocab": ["a"], "tokenizer_str": "{}", "stop_token_ids": [0]}
