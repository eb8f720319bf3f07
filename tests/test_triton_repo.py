"""python -m build_engine.triton_repo: the written config.pbtxt files parse with tritonclient's model_config_pb2
(text format) and hold what Triton's TensorRT-LLM backend needs; the Python steps tokenize like the service."""

from __future__ import annotations

import dataclasses
import json
import py_compile
import shutil
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from build_engine import spec
from build_engine.spec import load_engine_config
from build_engine.triton_models.backend_parameters import BATCHING_TYPES, REQUIRED_PARAMETERS, SOURCE_COMMIT
from build_engine.triton_models.postprocessing import Postprocessor
from build_engine.triton_models.preprocessing import Preprocessor
from build_engine.triton_models.tables import MODELS
from build_engine.triton_repo import STEPS, TRITON_IMAGE, main, parse_args
from build_engine.trtllm_runtime import TrtllmRuntime
from service.config import TrtllmConfig
from service.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def trtllm_engine(tmp_path_factory: pytest.TempPathFactory, tiny_engine_dir: Path) -> Path:
    """What build_engine --backend trtllm leaves for the generator to read: the manifest (our engine config and
    build settings) and the tokenizer files. The TensorRT engine files themselves are read by Triton, not by it."""
    d = tmp_path_factory.mktemp("trtllm") / "tiny-trtllm"
    d.mkdir()
    for name in (spec.TOKENIZER_FILE, spec.TOKENIZER_CONFIG_FILE, spec.CHAT_TEMPLATE_FILE):
        shutil.copy(tiny_engine_dir / name, d / name)
    engine = json.loads(load_engine_config(tiny_engine_dir).to_json()) | {"backend": "trtllm"}
    settings = {"dtype": "float16", "weight_only": "none", "tp_size": 1, "pp_size": 1}
    (d / spec.MANIFEST_FILE).write_text(json.dumps({"backend": "trtllm", "engine": engine, "settings": settings}))
    return d


def _parse(path: Path) -> mc.ModelConfig:
    return text_format.Parse(path.read_text(), mc.ModelConfig())


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, trtllm_engine: Path) -> Path:
    out = tmp_path_factory.mktemp("repo") / "triton_repo"
    assert main(["--engine", str(trtllm_engine), "--output", str(out), "--engine-path", "/engines/tiny"]) == 0
    return out


def test_every_config_parses_and_is_filled(repo: Path) -> None:
    assert sorted(p.name for p in repo.iterdir()) == sorted(STEPS)
    for name in STEPS:
        text = (repo / name / "config.pbtxt").read_text()
        assert "${" not in text  # nothing left for fill_template.py
        cfg = _parse(repo / name / "config.pbtxt")
        assert cfg.name == name and cfg.max_batch_size == 8  # the engine's max_batch_size
        assert (repo / name / "1").is_dir()  # Triton needs a version directory, even an empty one
        for t in (*cfg.input, *cfg.output):
            assert t.data_type != mc.TYPE_INVALID and list(t.dims), (name, t.name)


def test_tensorrt_llm_config_has_the_mandatory_values(repo: Path) -> None:
    cfg = _parse(repo / "tensorrt_llm" / "config.pbtxt")
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert cfg.backend == "tensorrtllm" and cfg.model_transaction_policy.decoupled  # decoupled_mode: streaming
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 0
    assert cfg.dynamic_batching.default_queue_policy.max_queue_size == 0
    assert list(cfg.dynamic_batching.preferred_batch_size) == [8]
    assert params["gpt_model_type"] == "inflight_fused_batching"  # batching_strategy
    assert params["gpt_model_path"] == "/engines/tiny"  # engine_dir, as mounted in the container
    assert params["kv_cache_free_gpu_mem_fraction"] == "0.9"  # paged KV: the share of free GPU memory
    assert params["enable_kv_cache_reuse"] == "true" and params["enable_chunked_context"] == "true"
    assert params["batch_scheduler_policy"] == "guaranteed_no_evict" and params["max_beam_width"] == "1"
    inputs = {i.name: i for i in cfg.input}
    assert {n for n, i in inputs.items() if not i.optional} == {"input_lengths", "request_output_len"}
    assert inputs["input_ids"].allow_ragged_batch and list(inputs["input_ids"].dims) == [-1]
    assert inputs["streaming"].reshape.shape == [] and inputs["streaming"].HasField("reshape")
    assert list(inputs["stop_words_list"].dims) == [2, -1]
    outputs = {o.name: o for o in cfg.output}
    assert outputs["arrival_time_ns"].data_type == mc.TYPE_INT64
    assert outputs["generation_logits"].data_type == mc.TYPE_FP32  # logits_datatype
    assert {"output_ids", "sequence_length", "num_output_tokens", "cum_log_probs"} <= set(outputs)


def test_tensorrt_llm_config_has_every_parameter_the_backend_reads_without_a_fallback(repo: Path) -> None:
    """The 1.2-era C++ backend reads these with GetParameter outside any try: a missing one fails model instance
    creation (backend_parameters.py, cited from model_instance_state.cc). Guided decoding is on (xgrammar, its
    tokenizer-info file inside the container); tokenizer_dir carries the value the C++ code treats as unset."""
    cfg = _parse(repo / "tensorrt_llm" / "config.pbtxt")
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert {p.name for p in REQUIRED_PARAMETERS} == {
        "gpt_model_type", "tokenizer_dir", "xgrammar_tokenizer_info_path", "guided_decoding_backend",
    }  # fmt: skip
    guided = {"guided_decoding_backend": "xgrammar",
              "xgrammar_tokenizer_info_path": "/triton/repo/tensorrt_llm/xgrammar_tokenizer_info.json"}  # fmt: skip
    for p in REQUIRED_PARAMETERS:
        assert p.name in params, f"{p.name} ({p.file} {p.function}) is read without a fallback"
        if p.unset is None:
            assert params[p.name], p.name  # no value means unset: a real one is needed
        else:
            assert params[p.name] == guided.get(p.name, p.unset), p.name
    assert params["gpt_model_type"] in BATCHING_TYPES
    assert params["gpt_model_path"]  # read with a fallback, but an empty path fails the next check
    assert len(SOURCE_COMMIT) == 40  # the table cites one commit (docs/triton.md)


def test_the_xgrammar_tokenizer_info_file_is_what_the_cpp_backend_reads(repo: Path, trtllm_engine: Path) -> None:
    """model_instance_state.cc reads tokenizerInfo["encoded_vocab"], ["tokenizer_str"] and ["stop_token_ids"] from
    the file xgrammar_tokenizer_info_path names (the format of TensorRT-LLM's generate_xgrammar_tokenizer_info.py)."""
    info = json.loads((repo / "tensorrt_llm" / "xgrammar_tokenizer_info.json").read_text())
    assert set(info) == {"encoded_vocab", "tokenizer_str", "stop_token_ids"}
    tok = Tokenizer.from_engine_dir(trtllm_engine)
    assert info["encoded_vocab"] == [tok.id_to_token(i) for i in range(tok.vocab_size)]
    assert info["tokenizer_str"] == (trtllm_engine / spec.TOKENIZER_FILE).read_text()
    assert info["stop_token_ids"] == list(load_engine_config(trtllm_engine).tokenizer.eos_token_ids)


def test_guided_decoding_off_and_another_mount(tmp_path: Path, trtllm_engine: Path) -> None:
    off = tmp_path / "off"
    assert main(["--engine", str(trtllm_engine), "--output", str(off), "--no-guided-decoding"]) == 0
    params = {k: v.string_value for k, v in _parse(off / "tensorrt_llm" / "config.pbtxt").parameters.items()}
    assert params["guided_decoding_backend"] == params["xgrammar_tokenizer_info_path"] == ""  # read as unset
    assert not (off / "tensorrt_llm" / "xgrammar_tokenizer_info.json").exists()
    moved = tmp_path / "moved"
    assert main(["--engine", str(trtllm_engine), "--output", str(moved), "--repo-path", "/models/"]) == 0
    params = {k: v.string_value for k, v in _parse(moved / "tensorrt_llm" / "config.pbtxt").parameters.items()}
    assert params["xgrammar_tokenizer_info_path"] == "/models/tensorrt_llm/xgrammar_tokenizer_info.json"


def test_the_ensemble_wires_its_steps(repo: Path) -> None:
    configs = {name: _parse(repo / name / "config.pbtxt") for name in STEPS}
    ens = configs["ensemble"]
    assert ens.platform == "ensemble" and [s.model_name for s in ens.ensemble_scheduling.step] == [
        "preprocessing", "tensorrt_llm", "postprocessing",
    ]  # fmt: skip
    available = {i.name for i in ens.input}
    for step in ens.ensemble_scheduling.step:
        step_cfg = configs[step.model_name]
        assert set(step.input_map) <= {i.name for i in step_cfg.input}, step.model_name
        assert set(step.input_map.values()) <= available, step.model_name
        assert set(step.output_map) <= {o.name for o in step_cfg.output}, step.model_name
        required = {i.name for i in step_cfg.input if not i.optional}
        assert required <= set(step.input_map), step.model_name  # every required input is fed
        available |= set(step.output_map.values())
    assert {o.name for o in ens.output} <= available
    # the repository's ensemble takes exactly the tensors the service's front door takes
    assert {(i.name, i.optional) for i in ens.input} == {(t.name, t.optional) for t in MODELS["ensemble"].inputs}
    for name in ("preprocessing", "postprocessing"):
        params = {k: v.string_value for k, v in configs[name].parameters.items()}
        assert params["tokenizer_dir"] == "/engines/tiny" and configs[name].backend == "python"
        py_compile.compile(str(repo / name / "1" / "model.py"), doraise=True)


def test_python_steps_tokenize_like_the_service(trtllm_engine: Path) -> None:
    tok = Tokenizer.from_engine_dir(trtllm_engine)
    pre = Preprocessor(str(trtllm_engine))
    out = pre.run({
        "QUERY": np.array([[b"Hello there"], [b"The capital of France is"]], dtype=np.object_),
        "REQUEST_OUTPUT_LEN": np.array([[8], [4]], dtype=np.int32),
        "STOP_WORDS_DICT": np.array([[b"the", b""], [b"x", b"is"]], dtype=np.object_),
        "END_ID": np.array([[-1], [-1]], dtype=np.int32),
    })  # fmt: skip
    first, second = tok.encode("Hello there"), tok.encode("The capital of France is")
    assert out["INPUT_ID"][0, : len(first)].tolist() == first and out["INPUT_ID"][1].tolist() == second
    assert out["REQUEST_INPUT_LEN"].tolist() == [[len(first)], [len(second)]]
    assert out["REQUEST_OUTPUT_LEN"].tolist() == [[8], [4]] and out["OUT_END_ID"].tolist() == [[-1], [-1]]
    assert out["OUT_PAD_ID"].tolist() == [[2], [2]]  # the engine's pad token
    the, x, is_ = (tok.encode(w, add_special_tokens=False) for w in ("the", "x", "is"))
    words = out["STOP_WORDS_IDS"]
    assert words.shape[:2] == (2, 2) and words[0, 0, : len(the)].tolist() == the
    assert [o for o in words[0, 1].tolist() if o >= 0] == [len(the)]
    assert [o for o in words[1, 1].tolist() if o >= 0] == [len(x), len(x) + len(is_)]
    assert out["BAD_WORDS_IDS"].tolist() == [[[0], [-1]], [[0], [-1]]]  # no words
    assert pre.run({"QUERY": np.array([[b"Hi"]], dtype=np.object_), "REQUEST_OUTPUT_LEN": np.array([[1]])})[
        "OUT_END_ID"
    ].tolist() == [[2]]  # the engine's end token when the request gives none


def test_postprocessing_emits_nvidias_flat_output(trtllm_engine: Path) -> None:
    """OUTPUT is np.array over a flat list of batch * beams texts, as NVIDIA's postprocessing model.py builds it,
    so NVIDIA's clients' output[0].decode() reads the first text (a [batch, beams] array has no .decode)."""
    tok = Tokenizer.from_engine_dir(trtllm_engine)
    post = Postprocessor(str(trtllm_engine))
    ids = tok.encode("Hello there, general")
    text = post.run(np.array([[ids + [0, 0]]], dtype=np.int32), np.array([[len(ids)]], dtype=np.int32))
    assert text.shape == (1,) and text.dtype == np.object_
    assert text[0].decode() == tok.decode(ids, skip_special_tokens=True)  # what end_to_end_grpc_client.py does
    other = tok.encode("The capital")
    rows = np.zeros((2, 1, len(ids)), dtype=np.int32)
    rows[0, 0], rows[1, 0, : len(other)] = ids, other
    two = post.run(rows, np.array([[len(ids)], [len(other)]], dtype=np.int32))
    assert two.shape == (2,) and [t.decode() for t in two] == [tok.decode(ids), tok.decode(other)]  # batch-major
    assert MODELS["postprocessing"].output("OUTPUT").dims == (-1,)  # NVIDIA's config.pbtxt: dims [ -1 ]


def test_refusals(tmp_path: Path, tiny_engine_dir: Path, trtllm_engine: Path, capsys) -> None:
    assert main(["--engine", str(tiny_engine_dir), "--output", str(tmp_path / "r")]) == 2
    assert "is a native engine" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep").write_text("x")
    assert main(["--engine", str(trtllm_engine), "--output", str(tmp_path / "busy")]) == 2
    assert "--force" in capsys.readouterr().err and (tmp_path / "busy" / "keep").exists()
    assert main(["--engine", str(trtllm_engine), "--output", str(tmp_path / "busy"), "--force",
                 "--max-batch-size", "4", "--no-block-reuse", "--scheduler-policy", "max_utilization"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert TRITON_IMAGE in printed and str(trtllm_engine.resolve()) in printed  # default engine path: the same
    assert not (tmp_path / "busy" / "keep").exists()
    cfg = _parse(tmp_path / "busy" / "tensorrt_llm" / "config.pbtxt")
    assert cfg.max_batch_size == 4 and cfg.parameters["enable_kv_cache_reuse"].string_value == "false"
    assert cfg.parameters["batch_scheduler_policy"].string_value == "max_utilization"
    assert cfg.parameters["gpt_model_path"].string_value == str(trtllm_engine.resolve())


def test_runtime_defaults_are_the_services() -> None:
    """The repository's TensorRT-LLM runtime defaults and the trtllm backend's are one definition (TrtllmRuntime)."""
    defaults = dataclasses.asdict(TrtllmRuntime())
    assert dataclasses.asdict(TrtllmConfig()) == defaults
    args = parse_args(["--engine", "e", "--output", "o"])
    assert args.kv_cache_free_gpu_memory_fraction == defaults["kv_cache_free_gpu_memory_fraction"]
    assert args.scheduler_policy == defaults["scheduler_policy"]
    assert (not args.no_chunked_context) == defaults["enable_chunked_context"]
