"""build_engine: inputs (tiny-random, HF directories, GGUF), determinism, manifest, and clean failures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from build_engine import spec
from build_engine.builder import build
from build_engine.hf_source import llama3_freq_factors
from build_engine.source import BuildError
from build_engine.spec import EngineConfig, EngineFormatError, load_engine_config, verify_manifest
from build_engine.tensor_io import SafetensorsFile
from build_engine.tiny import write_tiny_checkpoint
from service.tokenizer import Tokenizer
from tests.model_files import rewrite_checkpoint, write_tiny_gguf


def _files(engine: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(engine.iterdir())}


def _weights(engine: Path) -> dict[str, np.ndarray]:
    f = SafetensorsFile(engine / spec.WEIGHTS_FILE)
    return {k: np.array(f.get(k)) for k in f.keys()}


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "build_engine", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_tiny_random_build_is_byte_identical(tmp_path: Path) -> None:
    build("tiny-random", tmp_path / "a", progress=False)
    build("tiny-random", tmp_path / "b", progress=False)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")


@pytest.mark.slow
def test_smollm2_build_is_byte_identical(smollm2_engine_dir: Path, tmp_path: Path) -> None:
    build("smollm2-135m", tmp_path / "again", {"max_seq_len": 2048}, progress=False)
    assert (tmp_path / "again" / spec.MANIFEST_FILE).read_bytes() == (
        smollm2_engine_dir / spec.MANIFEST_FILE
    ).read_bytes()
    verify_manifest(tmp_path / "again")


@pytest.mark.slow
def test_smollm2_engine_config(smollm2_engine_dir: Path) -> None:
    cfg = load_engine_config(smollm2_engine_dir, verify=True)
    a = cfg.arch
    assert (a.num_hidden_layers, a.hidden_size, a.num_attention_heads, a.num_key_value_heads) == (30, 576, 9, 3)
    assert a.tie_word_embeddings and a.vocab_size == 49152 and a.rope_theta == 100000.0
    assert abs(a.num_parameters() - 134.5e6) < 0.1e6
    assert cfg.tokenizer.eos_token_ids == (2,) and cfg.source["kind"] == "gguf"
    assert (smollm2_engine_dir / spec.CHAT_TEMPLATE_FILE).is_file()


def test_manifest_detects_corruption(tmp_path: Path) -> None:
    out = tmp_path / "e"
    build("tiny-random", out, progress=False)
    verify_manifest(out)
    data = bytearray((out / spec.WEIGHTS_FILE).read_bytes())
    data[-1] ^= 0xFF
    (out / spec.WEIGHTS_FILE).write_bytes(bytes(data))
    with pytest.raises(EngineFormatError, match="checksum"):
        load_engine_config(out, verify=True)


def test_unknown_format_version_is_rejected(tiny_engine_dir: Path) -> None:
    doc = json.loads((tiny_engine_dir / spec.CONFIG_FILE).read_text())
    doc["format_version"] = spec.FORMAT_VERSION + 1
    with pytest.raises(EngineFormatError, match="format_version"):
        EngineConfig.from_json(json.dumps(doc))


def test_gguf_input_matches_hf_input(tmp_path: Path) -> None:
    """A GGUF file written like llama.cpp's converter (permuted Q/K rows) builds the same engine as the HF dir."""
    kw = {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}
    write_tiny_gguf(tmp_path / "tiny.gguf", seed=3, **kw)
    write_tiny_checkpoint(tmp_path / "hf", seed=3, **kw)
    build(str(tmp_path / "tiny.gguf"), tmp_path / "from-gguf", progress=False)
    build(str(tmp_path / "hf"), tmp_path / "from-hf", progress=False)
    a, b = _weights(tmp_path / "from-gguf"), _weights(tmp_path / "from-hf")
    assert a.keys() == b.keys() and "lm_head" in a
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    tok_gguf, tok_hf = (
        Tokenizer.from_engine_dir(tmp_path / "from-gguf"),
        Tokenizer.from_engine_dir(tmp_path / "from-hf"),
    )
    text = "Hello  42 worlds, <|im_end|> 東京 😀"
    assert tok_gguf.encode(text) == tok_hf.encode(text)
    assert tok_gguf.chat_template == tok_hf.chat_template


def test_bfloat16_and_sharded_checkpoints(tiny_checkpoint: Path, tmp_path: Path) -> None:
    tensors = rewrite_checkpoint(tiny_checkpoint, tmp_path / "bf16", bf16=True, shards=3)
    build(str(tmp_path / "bf16"), tmp_path / "engine", progress=False)
    embed = _weights(tmp_path / "engine")["embed"]
    truncated = (tensors["model.embed_tokens.weight"].view(np.uint32) & 0xFFFF0000).view(np.float32)
    np.testing.assert_array_equal(embed, truncated)


def test_llama3_rope_factors_keep_high_and_scale_low_frequencies() -> None:
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    f = llama3_freq_factors(128, 500000.0, scaling)
    assert f.shape == (64,)
    assert f[0] == 1.0 and f[-1] == pytest.approx(8.0)  # highest frequency kept, lowest divided by the factor
    assert np.all(np.diff(f) >= 0)


def test_existing_output_is_skipped_when_current_rebuilt_for_new_settings_refused_otherwise(tmp_path: Path) -> None:
    out = tmp_path / "e"
    assert _run_cli("--model", "tiny-random", "--output", str(out)).returncode == 0
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    again = _run_cli("--model", "tiny-random", "--output", str(out))  # the README's command, run twice
    assert again.returncode == 0 and "up to date" in again.stdout and "skipping the build" in again.stdout
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    other = _run_cli("--model", "tiny-random", "--output", str(out), "--max-num-tokens", "128")
    assert other.returncode == 0 and "rebuilding" in other.stderr  # same model, new settings: rebuilt
    assert load_engine_config(out).limits.max_num_tokens == 128
    with open(out / "model.safetensors", "r+b") as f:  # one byte flipped in place: damaged, so rebuilt
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))
    damaged = _run_cli("--model", "tiny-random", "--output", str(out), "--max-num-tokens", "128")
    assert damaged.returncode == 0 and "rebuilding" in damaged.stderr and verify_manifest(out) is None
    write_tiny_gguf(tmp_path / "other.gguf", seed=9)  # another model's engine is never replaced silently
    refused = _run_cli("--model", str(tmp_path / "other.gguf"), "--output", str(out))
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0 and "--force" in refused.stderr
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not an engine")
    assert _run_cli("--model", "tiny-random", "--output", str(tmp_path / "mine")).returncode == 2
    forced = _run_cli("--model", "tiny-random", "--output", str(out), "--force", "--max-num-tokens", "64")
    assert forced.returncode == 0
    assert load_engine_config(out).limits.max_num_tokens == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e", "mine", "other.gguf"]  # no temp or old directories


def _unsupported_arch(tmp: Path) -> Path:
    d = write_tiny_checkpoint(tmp / "mistral")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _truncated_gguf(tmp: Path) -> Path:
    write_tiny_gguf(tmp / "full.gguf")
    data = (tmp / "full.gguf").read_bytes()
    (tmp / "cut.gguf").write_bytes(data[: len(data) // 3])
    return tmp / "cut.gguf"


def _corrupt_safetensors(tmp: Path) -> Path:
    d = write_tiny_checkpoint(tmp / "corrupt")
    (d / "model.safetensors").write_bytes(b"\xff" * 64)
    return d


def _missing_tokenizer(tmp: Path) -> Path:
    d = write_tiny_checkpoint(tmp / "notok")
    (d / "tokenizer.json").unlink()
    return d


def _gguf_wrong_arch(tmp: Path) -> Path:
    write_tiny_gguf(tmp / "gpt2.gguf", arch="gpt2")
    return tmp / "gpt2.gguf"


@pytest.mark.parametrize(
    ("make_input", "message"),
    [
        (lambda tmp: tmp / "does-not-exist", "not found"),
        (_unsupported_arch, "unsupported architecture 'GPT2LMHeadModel'"),
        (_gguf_wrong_arch, "unsupported architecture 'gpt2'"),
        (_truncated_gguf, "not a valid GGUF file"),
        (_corrupt_safetensors, "corrupt safetensors header"),
        (_missing_tokenizer, "tokenizer.json is missing"),
    ],
    ids=["missing", "unsupported-hf", "unsupported-gguf", "truncated-gguf", "corrupt-safetensors", "no-tokenizer"],
)
def test_bad_inputs_fail_cleanly(make_input, message: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    model = make_input(src)
    out_parent = tmp_path / "out"
    result = _run_cli("--model", str(model), "--output", str(out_parent / "engine"))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert result.stderr.startswith("build_engine: error:") and result.stderr.strip().count("\n") == 0
    assert not out_parent.exists() or list(out_parent.iterdir()) == []  # nothing half-written left behind


def test_bad_limits_fail_cleanly(tmp_path: Path) -> None:
    result = _run_cli("--model", "tiny-random", "--output", str(tmp_path / "e"), "--max-seq-len", "100000")
    assert result.returncode == 2 and "max_position_embeddings" in result.stderr
    result = _run_cli("--model", "tiny-random", "--output", str(tmp_path / "e"), "--kv-block-size", "0")
    assert result.returncode == 2 and "kv_block_size must be positive" in result.stderr
    assert not (tmp_path / "e").exists()


def test_build_error_on_nan_weights(tiny_checkpoint: Path, tmp_path: Path) -> None:
    tensors = rewrite_checkpoint(tiny_checkpoint, tmp_path / "nan")
    tensors["model.norm.weight"][0] = np.nan
    from tests.model_files import write_safetensors

    for p in (tmp_path / "nan").glob("*.safetensors"):
        p.unlink()
    write_safetensors(tmp_path / "nan" / "model.safetensors", tensors)
    with pytest.raises(BuildError, match="NaN"):
        build(str(tmp_path / "nan"), tmp_path / "e", progress=False)
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_export_round_trips_through_our_loader(tmp_path: Path, dtype: str) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf")
    hf = tmp_path / "hf"
    out = _run_cli("--model", str(tmp_path / "tiny.gguf"), "--output", str(hf), "--format", "hf", "--dtype", dtype)
    assert out.returncode == 0, out.stderr
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == dtype
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "model.safetensors"} <= {
        p.name for p in hf.iterdir()
    }
    build(str(tmp_path / "tiny.gguf"), tmp_path / "from-gguf", progress=False)
    build(str(hf), tmp_path / "from-hf", progress=False)
    direct, via_hf = _weights(tmp_path / "from-gguf"), _weights(tmp_path / "from-hf")
    assert direct.keys() == via_hf.keys()
    for name in (
        direct
    ):  # the same weights, whichever way they came (bfloat16: weights and norm gains each rounded, so 2 x 2^-8)
        if dtype == "float32":
            np.testing.assert_array_equal(direct[name], via_hf[name])
        else:
            np.testing.assert_allclose(direct[name], via_hf[name], rtol=2**-7, atol=1e-6)
    again = _run_cli("--model", str(tmp_path / "tiny.gguf"), "--output", str(hf), "--format", "hf")
    assert again.returncode == 2 and "not empty" in again.stderr


def test_trtllm_build_without_tensorrt_llm_prints_one_line_and_writes_nothing(tmp_path: Path) -> None:
    out = _run_cli("--model", "tiny-random", "--output", str(tmp_path / "e"), "--backend", "trtllm")
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "tensorrt_llm" in out.stderr and "docs/gpu.md" in out.stderr
    assert not (tmp_path / "e").exists() and list(tmp_path.iterdir()) == []
    native = _run_cli("--model", "tiny-random", "--output", str(tmp_path / "n"), "--tp-size", "2")
    assert native.returncode == 2 and "--tp-size" in native.stderr and not (tmp_path / "n").exists()
    auto = _run_cli("--model", "tiny-random", "--output", str(tmp_path / "t"), "--backend", "trtllm", "--weight-only",
                    "auto")  # fmt: skip
    assert auto.returncode == 2 and not (tmp_path / "t").exists()
