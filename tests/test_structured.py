"""Structured outputs in the native engine (service/engine/grammar.py, docs/structured.md) on the real SmolLM2.

The set: 24 JSON schemas of our own (benchmarks/data/structured_schemas.json: nested objects, arrays with
minItems / maxItems, enums, anyOf, string patterns and formats, bounded numbers, required and optional keys), 8
regexes and an arithmetic grammar in Lark and in GBNF (benchmarks/data/structured_grammars.json), greedy and
sampled (temperature 1.0, seeded). Every output that ends with `stop` parses and validates (jsonschema; the
regex with re.fullmatch; the arithmetic with Python's parser), every `length` output is a prefix the grammar
accepts, and at least 95% end with `stop` at max_tokens = MAX_TOKENS. The whole set is `slow`; FAST is the
subset that always runs.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import grpc
import jsonschema
import numpy as np
import pytest

from protos.llm.v1 import llm_pb2
from service.api.llm.convert import check_fields
from service.api.worker import convert as worker_convert
from service.engine.core import EngineCore
from service.engine.grammar import SUPPORTED_KINDS, grammar_of
from service.errors import InvalidRequest
from service.request import Constraint, GenerateRequest, RequestOutput, SamplingParams
from tests.servers import ServerThread, generate, ids_and_text, running_server

DATA = Path(__file__).parent.parent / "benchmarks" / "data"
SCHEMAS = json.loads((DATA / "structured_schemas.json").read_text())
GRAMMARS = json.loads((DATA / "structured_grammars.json").read_text())
MAX_TOKENS = 200  # the stated budget: >= 95% of the set's outputs end with `stop` within it
STOP_RATE = 0.95
FAST = {"person", "tags_array", "anyof_shape", "phone", "arithmetic_gbnf"}
FORMATS = jsonschema.FormatChecker()


def _case_constraint(case: dict) -> Constraint:
    if "schema" in case:
        return Constraint("json_schema", json.dumps(case["schema"]))
    return Constraint(case["kind"], case["spec"])


def _check_valid(case: dict, text: str) -> None:
    """A complete output is what its constraint describes."""
    if "schema" in case:
        jsonschema.validate(json.loads(text), case["schema"], format_checker=FORMATS)
    elif case["kind"] == "regex":
        assert re.fullmatch(case["spec"], text), text
    else:  # the arithmetic grammar's language is a subset of Python's expressions
        ast.parse(text, mode="eval")


@pytest.fixture(scope="module")
def core(smollm2_engine_dir: Path) -> EngineCore:
    return EngineCore(smollm2_engine_dir, kv_cache_memory="256MiB")


def _prompt(core: EngineCore, text: str) -> list[int]:
    return core.tokenizer.encode_chat([{"role": "user", "content": text}])


def _text(outs: list[RequestOutput]) -> str:
    return "".join(o.new_text for o in outs)


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def _run_set(core: EngineCore, cases: list[dict]) -> None:
    gens, by_id = [], {}
    for case in cases:
        for mode, temperature in (("greedy", 0.0), ("sampled", 1.0)):
            sp = SamplingParams(
                max_tokens=MAX_TOKENS, temperature=temperature, seed=7, constraint=_case_constraint(case)
            )
            gen = GenerateRequest(f"{case['name']}/{mode}", _prompt(core, case["prompt"]), sp)
            gens.append(gen)
            by_id[gen.request_id] = case
    results = core.generate(gens)
    stops = 0
    for gen in gens:
        outs, case = results[gen.request_id], by_id[gen.request_id]
        reason = outs[-1].finish_reason
        assert reason in ("stop", "length"), (gen.request_id, outs[-1])
        if reason == "stop":
            stops += 1
            _check_valid(case, _text(outs))
        else:  # a valid prefix: the grammar accepts every token
            assert core.grammars.state(gen.sampling.constraint).accepts(_tokens(outs)), gen.request_id
    assert stops >= STOP_RATE * len(gens), f"{stops} of {len(gens)} ended with stop"
    assert not core.has_unfinished_requests() and core.kv.pool.num_used_blocks == 0


def test_fast_subset_validates(core: EngineCore) -> None:
    _run_set(core, [c for c in SCHEMAS + GRAMMARS if c["name"] in FAST])


@pytest.mark.slow
def test_the_whole_set_validates(core: EngineCore) -> None:
    assert len(SCHEMAS) >= 20
    _run_set(core, SCHEMAS + GRAMMARS)


# ---- the engine's rules ------------------------------------------------------------------------------------------
def _one(core: EngineCore, prompt: str, **sampling) -> list[RequestOutput]:
    gen = GenerateRequest("r", _prompt(core, prompt), SamplingParams(**sampling))
    return core.generate([gen])["r"]


def test_a_constraint_admitting_the_greedy_output_changes_nothing(core: EngineCore) -> None:
    free = _one(core, "What is the capital of France?", max_tokens=24, temperature=0)
    text = _text(free)
    for c in (Constraint("regex", r"[\s\S]*"), Constraint("choice", choices=(text, text + " Yes."))):
        constrained = _one(core, "What is the capital of France?", max_tokens=24, temperature=0, constraint=c)
        assert _tokens(constrained) == _tokens(free), c.kind
        assert constrained[-1].finish_reason == free[-1].finish_reason


def test_length_ends_with_a_valid_prefix(core: EngineCore) -> None:
    c = _case_constraint(SCHEMAS[0])
    outs = _one(core, SCHEMAS[0]["prompt"], max_tokens=5, temperature=0, constraint=c)
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 5
    assert core.grammars.state(c).accepts(_tokens(outs))


def test_choice_min_tokens_and_penalties(core: EngineCore) -> None:
    """The grammar wins over min_tokens where it allows nothing but the end; sampling transforms (penalties,
    top-k / top-p / min-p) keep to the mask."""
    c = Constraint("choice", choices=("yes", "no"))
    outs = _one(core, "Is water wet?", max_tokens=16, temperature=0, min_tokens=8, constraint=c)
    assert _text(outs) in ("yes", "no") and outs[-1].finish_reason == "stop"
    for seed in range(4):
        outs = _one(core, "Pick a color.", max_tokens=16, temperature=1.5, top_k=5, top_p=0.9, min_p=0.01,
                    repetition_penalty=1.3, presence_penalty=1.0, frequency_penalty=1.0, seed=seed,
                    constraint=Constraint("choice", choices=("red", "green", "blue")))  # fmt: skip
        assert _text(outs) in ("red", "green", "blue") and outs[-1].finish_reason == "stop"


def test_sixteen_constrained_and_sixteen_free_in_one_batch(core: EngineCore) -> None:
    free_prompts = [f"Tell me a fact about the number {i}." for i in range(16)]
    solo = {p: _tokens(_one(core, p, max_tokens=24, temperature=0)) for p in free_prompts}
    cases = [SCHEMAS[i % len(SCHEMAS)] for i in range(16)]
    gens = [
        GenerateRequest(f"c{i}", _prompt(core, case["prompt"]),
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, constraint=_case_constraint(case)))
        for i, case in enumerate(cases)
    ] + [
        GenerateRequest(f"f{i}", _prompt(core, p), SamplingParams(max_tokens=24, temperature=0))
        for i, p in enumerate(free_prompts)
    ]  # fmt: skip
    for gen in gens:
        core.add_request(gen)
    results: dict[str, list[RequestOutput]] = {g.request_id: [] for g in gens}
    batch_sizes = []
    while core.has_unfinished_requests():
        for out in core.step():
            results[out.request_id].append(out)
        batch_sizes.append(core.last_step.num_seqs)
        core.scheduler.check_invariants()
    assert max(batch_sizes) == 32  # all in one batch at once
    for i, case in enumerate(cases):
        outs = results[f"c{i}"]
        assert outs[-1].finish_reason in ("stop", "length")
        if outs[-1].finish_reason == "stop":
            _check_valid(case, _text(outs))
    for i, p in enumerate(free_prompts):
        assert results[f"f{i}"][-1].finish_reason in ("stop", "length")
        assert _tokens(results[f"f{i}"]) == solo[p], f"free request {i} changed beside constrained ones"


def test_preemption_keeps_the_matcher_state(smollm2_engine_dir: Path) -> None:
    """A recompute preemption neither resets the matcher nor consumes the generated tokens twice: the outputs
    equal those of a run without preemption."""
    cases = SCHEMAS[:6]

    def run(num_kv_blocks: int) -> tuple[dict[str, list[int]], int]:
        core = EngineCore(smollm2_engine_dir, num_kv_blocks=num_kv_blocks)
        gens = [
            GenerateRequest(c["name"], _prompt(core, c["prompt"]),
                            SamplingParams(max_tokens=48, temperature=0, constraint=_case_constraint(c)))
            for c in cases
        ]  # fmt: skip
        results = core.generate(gens)
        return {k: _tokens(v) for k, v in results.items()}, core.scheduler.num_preemptions

    calm, none = run(256)
    squeezed, preemptions = run(14)  # six prompts of ~40 tokens + outputs in 14 blocks of 16: some must yield
    assert none == 0 and preemptions > 0
    assert squeezed == calm


def test_mask_is_filled_beside_the_forward_and_free_requests_pay_nothing(core: EngineCore) -> None:
    _one(core, "Hello", max_tokens=4, temperature=0)
    assert core.last_step.mask_ms == 0.0
    _one(core, "Hello", max_tokens=4, temperature=0, constraint=Constraint("regex", "[a-z ]{1,40}"))
    assert core.last_step.mask_ms > 0.0


def test_compile_errors_name_the_field(core: EngineCore) -> None:
    bad = [
        (Constraint("json_schema", '{"type": "nope"}'), "constraint.json_schema: "),
        (Constraint("json_schema", "{not json"), "constraint.json_schema: not valid JSON"),
        (Constraint("regex", "a(b"), "constraint.regex: "),
        (Constraint("lark", "start: undefined_rule"), "constraint.lark_grammar: "),
        (Constraint("gbnf", "root ::= ("), "constraint.gbnf_grammar: "),
        (Constraint("structural_tag", '{"type": "structural_tag"}'), "constraint.structural_tag: "),
    ]
    for c, prefix in bad:
        with pytest.raises(InvalidRequest, match=re.escape(prefix)):
            core.grammars.compile(c)
    with pytest.raises(InvalidRequest, match="ignore_eos"):
        SamplingParams(ignore_eos=True, constraint=Constraint("json_object"))


def test_grammar_cache_is_bounded_and_keyed_by_text(smollm2_engine_dir: Path) -> None:
    core = EngineCore(smollm2_engine_dir, num_kv_blocks=16)
    core.grammars.cache_size = 3
    first = core.grammars.compile(Constraint("regex", "a+"))
    assert core.grammars.compile(Constraint("regex", "a+")) is first
    assert core.grammars.compile(Constraint("json_object", any_whitespace=False)) is not core.grammars.compile(
        Constraint("json_object")
    )
    for i in range(4):
        core.grammars.compile(Constraint("regex", f"b{{{i + 1}}}"))
    assert core.grammars.cached(Constraint("regex", "a+")) is None and len(core.grammars.keys()) == 3


def test_eos_is_the_engines(core: EngineCore) -> None:
    """llguidance would guess EOS = 0 for this tokenizer; the matcher ends on the engine's EOS id."""
    state = core.grammars.state(Constraint("choice", choices=("ok",)))
    state.consume(core.tokenizer.encode("ok"))
    assert state.is_accepting
    assert core.grammars.tokenizer.eos_tokens == sorted(core.eos_token_ids)
    masks = core.masks.start([(0, state)]).result()
    assert set(np.flatnonzero(masks.allowed(0))) == set(core.eos_token_ids)  # only the end, and it is the engine's
    state.consume(sorted(core.eos_token_ids)[:1])
    assert state.matcher.is_stopped()


def test_rollback_leaves_room_for_draft_tokens(core: EngineCore) -> None:
    """Several tokens per step: consume a draft, roll back the rejected part, continue from there."""
    state = core.grammars.state(Constraint("regex", "(abc|abd)[0-9]"))
    ids = {ch: core.tokenizer.encode(ch) for ch in "abcd7"}
    assert all(len(v) == 1 for v in ids.values())
    state.consume([ids["a"][0], ids["b"][0], ids["c"][0]])  # a draft of three tokens, the last one rejected
    state.rollback(1)
    assert state.num_consumed == 2
    state.consume([ids["d"][0], ids["7"][0]])
    assert state.is_accepting


# ---- no model: grammar text and the doors' mappings ---------------------------------------------------------------
def test_choice_literals_are_escaped() -> None:
    g = grammar_of(Constraint("choice", choices=('say "hi"', "back\\slash", "new\nline")))
    assert '"say \\"hi\\""' in g and '"back\\\\slash"' in g and '"new\\nline"' in g


def test_llm_v1_constraint_fields() -> None:
    def sampling(**constraint) -> SamplingParams:
        return check_fields(llm_pb2.GenerateRequest(prompt="x", constraint=llm_pb2.Constraint(**constraint)))[1]

    assert sampling(json_schema='{"type": "object"}').constraint == Constraint("json_schema", '{"type": "object"}')
    assert sampling(json_object=True, disable_any_whitespace=True).constraint == Constraint(
        "json_object", any_whitespace=False
    )
    assert sampling(lark_grammar="start: /a+/").constraint.kind == "lark"
    assert sampling(gbnf_grammar='root ::= "a"').constraint.kind == "gbnf"
    assert sampling(choice=llm_pb2.ChoiceConstraint(choices=["a", "b"])).constraint.choices == ("a", "b")
    for bad, field in (
        ({}, "constraint: one of"),
        ({"json_object": False}, "constraint.json_object: "),
        ({"choice": llm_pb2.ChoiceConstraint()}, "constraint.choice: "),
        ({"regex": ""}, "constraint.regex: "),
    ):
        with pytest.raises(InvalidRequest, match=re.escape(field)):
            sampling(**bad)
    req = llm_pb2.GenerateRequest(prompt="x", constraint=llm_pb2.Constraint(regex="a"))
    req.stopping.ignore_eos = True
    with pytest.raises(InvalidRequest, match=r"^stopping\.ignore_eos"):
        check_fields(req)


def test_worker_door_guided_decoding() -> None:
    pb = worker_convert.pb
    gd = pb.GuidedDecodingParams

    def constraint(guide_type: int, guide: str = "") -> Constraint:
        req = pb.GenerateRequest(
            request_id="r",
            tokenized=pb.TokenizedInput(input_token_ids=[1, 2]),
            max_tokens=4,
            guided_decoding=gd(guide_type=guide_type, guide=guide),
        )
        return worker_convert.to_domain(req, 100, "").sampling.constraint

    assert constraint(gd.GUIDE_TYPE_JSON) == Constraint("json_object")
    assert constraint(gd.GUIDE_TYPE_JSON_SCHEMA, '{"type": "object"}') == Constraint(
        "json_schema", '{"type": "object"}'
    )
    assert constraint(gd.GUIDE_TYPE_REGEX, "a+") == Constraint("regex", "a+")
    assert constraint(gd.GUIDE_TYPE_EBNF_GRAMMAR, 'root ::= "a"') == Constraint("gbnf", 'root ::= "a"')
    assert constraint(gd.GUIDE_TYPE_STRUCTURAL_TAG, "{}").kind == "structural_tag"
    with pytest.raises(InvalidRequest, match=r"^guided_decoding\.guide_type"):
        constraint(gd.GUIDE_TYPE_UNSPECIFIED)
    with pytest.raises(InvalidRequest, match=r"^guided_decoding\.guide: "):
        constraint(gd.GUIDE_TYPE_REGEX)
    assert worker_convert.proto_names("constraint.regex: bad").startswith("guided_decoding.guide: ")
    assert worker_convert.proto_names("constraint: the x backend").startswith("guided_decoding: the x backend")


# ---- over gRPC -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(smollm2_engine_dir: Path):
    with running_server(smollm2_engine_dir) as srv:
        yield srv


def _request(constraint: llm_pb2.Constraint, max_tokens: int = 64, **kw) -> llm_pb2.GenerateRequest:
    return llm_pb2.GenerateRequest(
        messages=llm_pb2.ChatMessages(
            messages=[llm_pb2.ChatMessage(role="user", content="Describe a person as JSON.")]
        ),
        sampling=llm_pb2.SamplingParams(temperature=0),
        stopping=llm_pb2.StoppingParams(max_tokens=max_tokens, **kw),
        constraint=constraint,
    )


@pytest.mark.server
def test_over_grpc_valid_json_and_model_info(server: ServerThread) -> None:
    schema = SCHEMAS[0]["schema"]
    chunks, complete = generate(server.stub(), _request(llm_pb2.Constraint(json_schema=json.dumps(schema))))
    assert complete.finish_reason == llm_pb2.FINISH_REASON_STOP
    jsonschema.validate(json.loads(ids_and_text(chunks)[1]), schema)
    info = server.stub().GetModelInfo(llm_pb2.GetModelInfoRequest())
    assert list(info.constraint_kinds) == ["json_schema", "json_object", "regex", "lark_grammar", "gbnf_grammar",
                                           "choice"]  # fmt: skip
    assert len(SUPPORTED_KINDS) == len(info.constraint_kinds)
    assert server.idle()


@pytest.mark.server
@pytest.mark.parametrize(
    ("constraint", "field"),
    [
        (llm_pb2.Constraint(json_schema='{"type": 5}'), "constraint.json_schema: "),
        (llm_pb2.Constraint(regex="(unclosed"), "constraint.regex: "),
        (llm_pb2.Constraint(lark_grammar="start: nothing_here"), "constraint.lark_grammar: "),
        (llm_pb2.Constraint(gbnf_grammar="root ::= ("), "constraint.gbnf_grammar: "),
        (llm_pb2.Constraint(structural_tag="{}"), "constraint: the native backend does not support structural_tag"),
        (llm_pb2.Constraint(), "constraint: "),
    ],
)
def test_bad_constraint_is_invalid_argument_naming_the_field(
    server: ServerThread, constraint: llm_pb2.Constraint, field: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        generate(server.stub(), _request(constraint))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field), err.value.details()
    assert server.idle()


@pytest.mark.server
def test_a_new_constraint_compiles_off_the_event_loop(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    grammars, real = server.core.grammars, server.core.grammars.compile
    threads = []

    def compile_(c: Constraint):
        threads.append(threading.current_thread())
        return real(c)

    monkeypatch.setattr(grammars, "compile", compile_)
    _, complete = generate(server.stub(), _request(llm_pb2.Constraint(regex="(hello|hi) there"), max_tokens=16))
    assert complete.finish_reason == llm_pb2.FINISH_REASON_STOP
    loop_thread = server.run(_current_thread())
    assert threads and loop_thread not in threads
    assert server.idle()


async def _current_thread():
    import threading

    return threading.current_thread()


@pytest.mark.server
def test_cancelled_constrained_requests_return_their_kv_blocks(server: ServerThread) -> None:
    stub = server.stub()
    schema = json.dumps({"type": "array", "items": {"type": "string"}})  # long: still running when cancelled
    calls = [stub.Generate(_request(llm_pb2.Constraint(json_schema=schema), max_tokens=400)) for _ in range(8)]
    for call in calls:
        assert next(call).HasField("chunk")  # each is decoding
    for call in calls:
        call.cancel()
    assert server.idle(), "KV blocks or requests left after the cancels"
    assert server.core.kv.pool.num_used_blocks == 0


def test_bitmask_rows_unpack_to_the_vocabulary() -> None:
    from service.engine.grammar import BatchMasks

    bitmask = np.zeros((1, 2), dtype=np.int32)
    bitmask[0, 0] = 1 << 3
    bitmask[0, 1] = 1  # token 32
    allowed = BatchMasks.of({5: 0}, bitmask, 40).allowed(5)
    assert allowed.shape == (40,) and list(np.flatnonzero(allowed)) == [3, 32]


def test_clients_send_the_constraint(tmp_path: Path) -> None:
    from clients.common import build_request
    from clients.loadtest.backends import LLMBackend, Sampling
    from clients.loadtest.openai_http import request_body
    from clients.loadtest.workload import WorkItem
    from clients.stream import parse_args as stream_args

    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object"}')
    grammar = tmp_path / "g.lark"
    grammar.write_text("start: /a+/")
    for flags, field in (
        (["--json-schema", str(schema)], "json_schema"),
        (["--json-object"], "json_object"),
        (["--regex", "[0-9]+"], "regex"),
        (["--grammar", str(grammar)], "lark_grammar"),
        (["--gbnf", str(grammar)], "gbnf_grammar"),
        (["--choice", "yes", "no"], "choice"),
    ):
        req = build_request(stream_args(["hi", *flags]), "hi", False)
        assert req.constraint.WhichOneof("kind") == field, flags
    assert not build_request(stream_args(["hi"]), "hi", False).HasField("constraint")
    item = WorkItem(prompt="hi", prompt_token_ids=None, input_tokens=1, max_tokens=8)
    sampling = Sampling(ignore_eos=False, json_schema='{"type": "object"}')
    assert LLMBackend.request(None, item, sampling).constraint.json_schema == '{"type": "object"}'  # type: ignore[arg-type]
    body = request_body("chat", "m", item, sampling)
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "loadtest", "schema": {"type": "object"}},
    }


def test_offline_prompts_file_constraint(smollm2_engine_dir: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    schema = SCHEMAS[0]["schema"]
    lines = [
        {
            "prompt": SCHEMAS[0]["prompt"],
            "chat": True,
            "max_tokens": 64,
            "constraint": {"kind": "json_schema", "spec": schema},
        },
        {"prompt": "Pick one.", "chat": True, "constraint": {"kind": "choice", "choices": ["left", "right"]}},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    out = subprocess.run([sys.executable, "-m", "service.offline", "--engine", str(smollm2_engine_dir), "--prompts-file",
                          str(path), "--json", "--skip-verify"], capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    results = [json.loads(line) for line in out.stdout.splitlines()]
    jsonschema.validate(json.loads(results[0]["text"]), schema)
    assert results[1]["text"] in ("left", "right")
    path.write_text(json.dumps({"prompt": "x", "constraint": {"kind": "regex", "spec": "(bad"}}))
    bad = subprocess.run([sys.executable, "-m", "service.offline", "--engine", str(smollm2_engine_dir), "--prompts-file",
                          str(path), "--skip-verify"], check=False, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2 and ":1: constraint.regex: " in bad.stderr, bad.stderr
