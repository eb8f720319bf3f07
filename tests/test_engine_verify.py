"""build_engine.verify: a damaged or inconsistent engine directory is refused at load with one line naming the file
and the problem; `python -m service` then exits 2 before binding anything, and --skip-verify skips only the
checksums."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from build_engine import spec
from build_engine.builder import build
from build_engine.quantize import WeightPlan
from build_engine.spec import EngineFormatError, load_engine_config
from build_engine.trtllm_builder import TrtllmOptions
from build_engine.verify import verify_engine
from protos.llm.v1 import llm_pb2, llm_pb2_grpc
from service.__main__ import config_from_args, parse_args
from service.backends import preflight
from service.config import BackendConfig
from tests.servers import free_port, wait_serving
from tests.trtllm_double import installed


@pytest.fixture
def engine(tiny_engine_dir: Path, tmp_path: Path) -> Path:
    """A copy of the tiny engine to damage."""
    return Path(shutil.copytree(tiny_engine_dir, tmp_path / "engine"))


@pytest.fixture(scope="module")
def int8_engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with packed (U8, q8_0 blocks) matrices."""
    out = tmp_path_factory.mktemp("engines") / "tiny-int8"
    build("tiny-random", out, {"max_seq_len": 256}, progress=False, weights=WeightPlan("int8"))
    return out


def reseal(engine: Path) -> None:
    """Rewrite manifest.json to match the files as they are now, as someone editing an engine on purpose would:
    only the structural checks can catch what is wrong then."""
    path = engine / spec.MANIFEST_FILE
    manifest = json.loads(path.read_text())
    manifest["files"] = {
        name: {"bytes": (engine / name).stat().st_size, "sha256": spec.sha256_file(engine / name)}
        for name in manifest["files"]
        if (engine / name).is_file()
    }
    path.write_text(json.dumps(manifest))


def flip_middle(path: Path, count: int = 64) -> None:
    """XOR `count` bytes in the middle of the file with 0xFF: its size stays the same."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    path.write_bytes(bytes(data))


def flip_weight_bit(path: Path) -> None:
    """Flip the lowest mantissa bit of one float32 in the middle of model.safetensors' data: a different file,
    an engine that still computes (never NaN)."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    middle = len(data) // 2
    middle -= (middle - start) % 4  # the first (least significant) byte of a float32
    data[middle] ^= 0x01
    path.write_bytes(bytes(data))


def edit_json(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc, indent=2))


def set_arch(engine: Path, **fields: object) -> None:
    edit_json(engine / spec.CONFIG_FILE, lambda doc: doc["architecture"].update(fields))


# ---- the verify function -----------------------------------------------------------------------------------------


def test_intact_engines_pass(tiny_engine_dir: Path, int8_engine_dir: Path) -> None:
    for engine in (tiny_engine_dir, int8_engine_dir):
        assert verify_engine(engine) == load_engine_config(engine)
        assert verify_engine(engine, checksums=False) == load_engine_config(engine)


@pytest.mark.slow
def test_smollm2_engine_passes(smollm2_engine_dir: Path) -> None:
    """The real packed engine (q4 and q8_0 blocks, separate norm gains, tied embedding)."""
    assert verify_engine(smollm2_engine_dir).arch.num_hidden_layers == 30


def test_flipped_weight_bytes_fail_the_checksum(engine: Path) -> None:
    size = (engine / spec.WEIGHTS_FILE).stat().st_size
    flip_middle(engine / spec.WEIGHTS_FILE)
    assert (engine / spec.WEIGHTS_FILE).stat().st_size == size
    with pytest.raises(
        EngineFormatError, match=r"model\.safetensors does not match .*manifest\.json: its sha256 checksum differs"
    ):
        verify_engine(engine)
    verify_engine(engine, checksums=False)  # the structure is intact: only the checksum can tell


def test_vocab_size_beyond_the_embedding_rows(engine: Path) -> None:
    set_arch(engine, vocab_size=600)  # the tiny model has 267 embedding rows
    with pytest.raises(EngineFormatError, match=r"config\.json does not match .*manifest\.json"):
        verify_engine(engine)  # an edited file fails the checksum first
    reseal(engine)
    for checksums in (True, False):
        with pytest.raises(EngineFormatError, match=r"tensor embed is \[267, 64\].*\[vocab_size, hidden_size\]"):
            verify_engine(engine, checksums=checksums)


@pytest.mark.parametrize("layers", [3, 1])
def test_num_hidden_layers_against_the_weights(engine: Path, layers: int) -> None:
    set_arch(engine, num_hidden_layers=layers)  # the tiny model has 2
    reseal(engine)
    with pytest.raises(EngineFormatError, match=rf"holds 2 layers .* num_hidden_layers {layers}"):
        verify_engine(engine)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hidden_size": 128, "head_dim": 32}, r"tensor embed is \[267, 64\]"),
        ({"intermediate_size": 256}, r"tensor layers\.0\.gate_up is \[256, 64\].*\[2 x intermediate_size"),
        ({"num_key_value_heads": 4}, r"layers\.0\.qkv is \[128, 64\].*num_key_value_heads"),
        ({"tie_word_embeddings": False}, r"has no tensor lm_head"),
        ({"rope_freq_factors": True}, r"has no tensor rope_freq_factors"),
    ],
)
def test_every_dimension_the_runner_reads_is_checked(engine: Path, fields: dict, message: str) -> None:
    set_arch(engine, **fields)
    with pytest.raises(EngineFormatError, match=message):
        verify_engine(engine, checksums=False)


def test_packed_tensors_are_checked_in_their_layout(int8_engine_dir: Path, tmp_path: Path) -> None:
    engine = Path(shutil.copytree(int8_engine_dir, tmp_path / "engine"))
    path = engine / spec.WEIGHTS_FILE
    with safe_open(str(path), "np") as f:
        metadata = f.metadata()
    packed = json.loads(metadata["packed"])
    assert packed["layers.0.o"]["kind"] == "q8_0" and packed["layers.0.o"]["rows"] == 64
    packed["layers.0.o"]["rows"] = 96  # one more tile than the stored blocks hold
    save_file(load_file(str(path)), str(path), metadata={"packed": json.dumps(packed)})
    reseal(engine)
    with pytest.raises(EngineFormatError, match=r"packed tensor layers\.0\.o is stored as U8 \[2, 2, 1088\]"):
        verify_engine(engine)


def test_truncated_weights_fail_without_checksums(engine: Path) -> None:
    path = engine / spec.WEIGHTS_FILE
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(
        EngineFormatError, match=r"model\.safetensors does not match .*manifest\.json: \d+ bytes, \d+ expected"
    ):
        verify_engine(engine)
    with pytest.raises(EngineFormatError, match=r"truncated or has inconsistent offsets"):
        verify_engine(engine, checksums=False)


def test_garbage_tokenizer(engine: Path) -> None:
    (engine / spec.TOKENIZER_FILE).write_bytes(os.urandom(6000))
    with pytest.raises(EngineFormatError, match=r"tokenizer\.json does not match .*manifest\.json: 6000 bytes"):
        verify_engine(engine)
    reseal(engine)
    with pytest.raises(EngineFormatError, match=r"tokenizer\.json is not a tokenizers file") as err:
        verify_engine(engine)
    assert "\n" not in str(err.value)


def test_missing_tokenizer(engine: Path) -> None:
    (engine / spec.TOKENIZER_FILE).unlink()
    with pytest.raises(EngineFormatError, match=r"tokenizer\.json is listed in .*manifest\.json but missing"):
        verify_engine(engine)
    with pytest.raises(EngineFormatError, match=r"tokenizer\.json is missing"):
        verify_engine(engine, checksums=False)


def test_tokenizer_ids_beyond_vocab_size(engine: Path) -> None:
    def add_token(doc: dict) -> None:
        doc["added_tokens"].append({"id": 267, "content": "<extra>", "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": True})  # fmt: skip

    edit_json(engine / spec.TOKENIZER_FILE, add_token)
    with pytest.raises(EngineFormatError, match=r"tokenizer\.json has token id 267, beyond config\.json's vocab_size"):
        verify_engine(engine, checksums=False)


def test_config_token_ids_beyond_vocab_size(engine: Path) -> None:
    edit_json(engine / spec.CONFIG_FILE, lambda doc: doc["tokenizer"].update(eos_token_ids=[2, 300]))
    with pytest.raises(EngineFormatError, match=r"eos_token_ids 300 is outside vocab_size 267"):
        verify_engine(engine, checksums=False)


def test_chat_template_syntax_error(engine: Path) -> None:
    (engine / spec.CHAT_TEMPLATE_FILE).write_text("{% for m in messages %}\n{{ m.content }\n")
    reseal(engine)
    with pytest.raises(EngineFormatError, match=r"chat_template\.jinja: line 2: template syntax error") as err:
        verify_engine(engine)
    assert "\n" not in str(err.value)


def test_an_engine_without_a_chat_template_passes(engine: Path) -> None:
    (engine / spec.CHAT_TEMPLATE_FILE).unlink()
    reseal(engine)
    verify_engine(engine)


# ---- TensorRT-LLM engines (built with the test double) -------------------------------------------------------------


@pytest.fixture(scope="module")
def trtllm_engine_dir(tmp_path_factory: pytest.TempPathFactory):
    with installed():
        out = tmp_path_factory.mktemp("trtllm") / "tiny-fp16"
        build("tiny-random", out, {"max_seq_len": 256}, progress=False, backend="trtllm",
              trtllm=TrtllmOptions(dtype="float16"))  # fmt: skip
        yield out


def test_trtllm_engine_is_verified(trtllm_engine_dir: Path, tmp_path: Path) -> None:
    assert verify_engine(trtllm_engine_dir).backend == "trtllm"
    engine = Path(shutil.copytree(trtllm_engine_dir, tmp_path / "engine"))
    flip_middle(engine / "rank0.engine", count=4)
    with pytest.raises(EngineFormatError, match=r"rank0\.engine does not match .*: its sha256 checksum differs"):
        verify_engine(engine)
    edit_json(engine / spec.CONFIG_FILE, lambda doc: doc["pretrained_config"].update(num_hidden_layers=31))
    reseal(engine)
    with pytest.raises(EngineFormatError, match=r"config\.json says num_hidden_layers 31, but .* num_hidden_layers 2"):
        verify_engine(engine)
    (engine / "rank0.engine").unlink()
    with pytest.raises(EngineFormatError, match=r"rank0\.engine is missing"):
        verify_engine(engine, checksums=False)


def test_preflight_verifies_every_backend(trtllm_engine_dir: Path, tmp_path: Path) -> None:
    """What python -m service runs before binding: the trtllm backend's engine too, and --skip-verify's config."""
    engine = Path(shutil.copytree(trtllm_engine_dir, tmp_path / "engine"))
    with installed():
        preflight(BackendConfig(engine_dir=str(engine)))
        (engine / spec.TOKENIZER_CONFIG_FILE).write_text("[]")
        with pytest.raises(EngineFormatError, match=r"tokenizer_config\.json does not match .*manifest\.json"):
            preflight(BackendConfig(engine_dir=str(engine)))
        with pytest.raises(EngineFormatError, match=r"tokenizer_config\.json is not a JSON object"):
            preflight(BackendConfig(engine_dir=str(engine), verify_checksums=False))


def test_skip_verify_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLM_SKIP_VERIFY", raising=False)
    assert config_from_args(parse_args(["--engine", "e"])).backend.verify_checksums
    assert not config_from_args(parse_args(["--engine", "e", "--skip-verify"])).backend.verify_checksums
    monkeypatch.setenv("LLM_SKIP_VERIFY", "1")
    assert not config_from_args(parse_args(["--engine", "e"])).backend.verify_checksums


# ---- python -m service -------------------------------------------------------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LLM_SKIP_VERIFY"}
    return {**env, **extra}


def _serve_cmd(engine: Path, port: int = 0, *flags: str) -> list[str]:
    return [sys.executable, "-m", "service", "--engine", str(engine), "--port", str(port), "--metrics-port", "-1",
            "--no-measure-ceilings", "--kv-cache-memory", "64MiB", *flags]  # fmt: skip


def _damage_weights(engine: Path) -> None:
    flip_middle(engine / spec.WEIGHTS_FILE)


def _vocab_60000(engine: Path) -> None:
    set_arch(engine, vocab_size=60000)
    reseal(engine)


def _garbage_tokenizer(engine: Path) -> None:
    (engine / spec.TOKENIZER_FILE).write_text('{"model": ')


def _template_syntax_error(engine: Path) -> None:
    (engine / spec.CHAT_TEMPLATE_FILE).write_text("{% if messages %}never closed")


@pytest.mark.parametrize(
    ("damage", "flags", "env", "expected"),
    [
        (_damage_weights, (), {}, ("model.safetensors", "manifest.json", "sha256 checksum differs")),
        (_vocab_60000, (), {}, ("tensor embed", "vocab_size")),
        (_garbage_tokenizer, ("--skip-verify",), {}, ("tokenizer.json is not a tokenizers file",)),
        (_template_syntax_error, (), {"LLM_SKIP_VERIFY": "1"}, ("chat_template.jinja: line 1", "syntax error")),
    ],
    ids=["flipped-weights", "vocab-60000", "garbage-tokenizer", "template-syntax"],
)
def test_service_refuses_a_bad_engine_in_one_line(engine: Path, damage, flags, env, expected) -> None:
    damage(engine)
    out = subprocess.run(_serve_cmd(engine, 0, *flags), capture_output=True, text=True, timeout=60,
                         env=_env(**env), check=False)  # fmt: skip
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1, out.stderr  # nothing was bound, nothing logged as listening, no traceback
    assert "cannot start:" in lines[0] and all(e in lines[0] for e in expected), lines[0]


@pytest.mark.server
def test_skip_verify_serves_an_engine_whose_checksum_fails(engine: Path) -> None:
    flip_weight_bit(engine / spec.WEIGHTS_FILE)
    with pytest.raises(EngineFormatError, match="checksum"):
        verify_engine(engine)
    port = free_port()
    proc = subprocess.Popen(_serve_cmd(engine, port, "--skip-verify"), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_serving(f"127.0.0.1:{port}", proc)
        stub = llm_pb2_grpc.LLMServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        req = llm_pb2.GenerateRequest(prompt="hi", stopping=llm_pb2.StoppingParams(max_tokens=3, ignore_eos=True))
        responses = list(stub.Generate(req, timeout=30))
        assert responses[-1].complete.usage.completion_tokens == 3
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert "checksums skipped" in stderr
