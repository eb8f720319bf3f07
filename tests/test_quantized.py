"""Weights kept as quantized blocks (--weight-only auto|int8|int4): exact against the same blocks dequantized.

- A GGUF's own Q4_0 / Q4_1 / Q8_0 blocks (auto) give the logits of the float32 engine built from the same file
  (same numbers, other summation order), and paged == naive, the naive forward reading the engine's blocks
  dequantized (norm gains and the attention scale applied where the engine applies them).
- int8 / int4 quantized at build time: paged == naive on the dequantized blocks as well.
- The kernels' backends (C extension, numba, numpy) agree; the embedding's row lookup equals a full dequantize.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from build_engine.builder import build
from build_engine.packing import dequantize_packed, dequantize_rows, from_stored
from build_engine.quantize import WeightPlan
from build_engine.spec import load_engine_config
from build_engine.tensor_io import SafetensorsFile, write_safetensors
from build_engine.tiny import write_tiny_checkpoint
from service.backends.native import _info as native_info
from service.engine.core import EngineCore
from service.engine.kernels import matmul as kernels
from service.engine.kernels import threads
from service.engine.kernels.backend import BACKEND
from service.engine.runners.base import ForwardBatch, SeqChunk
from service.engine.runners.numpy_runner import NumpyRunner
from service.engine.stats import StepCost
from tests.model_files import write_tiny_gguf
from tests.naive_llama import NaiveLlama

MAX_REL_ERR = 1e-4
LIMITS = {"max_seq_len": 256, "kv_block_size": 16}


def _rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def engine_as_checkpoint(engine: Path, out: Path) -> Path:
    """The engine's weights, dequantized and unfused, as a Hugging Face checkpoint the naive forward reads."""
    cfg = load_engine_config(engine)
    a = cfg.arch
    f = SafetensorsFile(engine / "model.safetensors")
    packed = json.loads(f.metadata.get("packed", "{}"))
    folded = packed.pop("q_scale_folded", {})

    def get(name: str) -> np.ndarray:
        return dequantize_packed(from_stored(f.raw(name)[0], packed[name])) if name in packed else f.get(name)

    w = {"model.embed_tokens.weight": get("embed"), "model.norm.weight": f.get("final_norm")}
    if not a.tie_word_embeddings:
        w["lm_head.weight"] = get("lm_head")
    q, kv, ff = a.q_size, a.kv_size, a.intermediate_size
    for i in range(a.num_hidden_layers):
        p, hf = f"layers.{i}.", f"model.layers.{i}."
        qkv = get(p + "qkv").astype(np.float64)
        if folded.get(p + "qkv"):
            qkv[:q] *= np.sqrt(a.head_dim)  # undo the folded 1/sqrt(hd): the naive forward applies it itself
        gate_up = get(p + "gate_up")
        w.update({
            hf + "self_attn.q_proj.weight": qkv[:q], hf + "self_attn.k_proj.weight": qkv[q : q + kv],
            hf + "self_attn.v_proj.weight": qkv[q + kv :], hf + "self_attn.o_proj.weight": get(p + "o"),
            hf + "mlp.gate_proj.weight": gate_up[:ff], hf + "mlp.up_proj.weight": gate_up[ff:],
            hf + "mlp.down_proj.weight": get(p + "down"),
            hf + "input_layernorm.weight": f.get(p + "attn_norm"),
            hf + "post_attention_layernorm.weight": f.get(p + "ffn_norm"),
        })  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", w)
    hf_cfg = {"num_attention_heads": a.num_attention_heads, "num_key_value_heads": a.num_key_value_heads,
              "head_dim": a.head_dim, "num_hidden_layers": a.num_hidden_layers, "rope_theta": a.rope_theta,
              "rms_norm_eps": a.rms_norm_eps, "hidden_size": a.hidden_size}  # fmt: skip
    (out / "config.json").write_text(json.dumps(hf_cfg))
    return out


def _paged_vs_naive(engine: Path, tmp: Path) -> float:
    runner = NumpyRunner(engine, num_kv_blocks=64)
    naive = NaiveLlama(engine_as_checkpoint(engine, tmp / "naive"))
    rng = np.random.default_rng(0)
    seqs = [list(rng.integers(3, 260, size=n)) for n in (9, 30, 17)]
    worst, blocks = 0.0, list(range(64))[::-1]
    tables = [blocks[i * 16 : (i + 1) * 16] for i in range(len(seqs))]
    prefix = [max(1, len(s) - 4) for s in seqs]  # a prefill chunk each, then decodes
    logits = runner.execute(ForwardBatch.from_chunks([SeqChunk(s[:n], 0, t) for s, n, t in zip(seqs, prefix, tables, strict=True)], 16))  # fmt: skip
    refs = [naive.forward(s) for s in seqs]
    worst = max(_rel_err(logits[i], refs[i][prefix[i] - 1]) for i in range(len(seqs)))
    for step in range(3):  # decode steps of all three together
        chunks = [SeqChunk([s[n + step]], n + step, t) for s, n, t in zip(seqs, prefix, tables, strict=True)]
        logits = runner.execute(ForwardBatch.from_chunks(chunks, 16))
        worst = max(worst, *(_rel_err(logits[i], refs[i][prefix[i] + step]) for i in range(len(seqs))))
    return worst


@pytest.mark.parametrize("quant", ["q4_0", "q4_1", "q8_0"])
def test_gguf_blocks_kept_as_they_are_are_exact(quant: str, tmp_path: Path) -> None:
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, seed=3, quant=quant)
    packed, fp32 = tmp_path / "auto", tmp_path / "fp32"
    build(str(gguf), packed, LIMITS, progress=False)  # --weight-only auto is the default
    build(str(gguf), fp32, LIMITS, progress=False, weights=WeightPlan("none"))
    assert load_engine_config(packed).weight_format == quant
    assert load_engine_config(fp32).weight_format == "float32"
    assert (packed / "model.safetensors").stat().st_size < (fp32 / "model.safetensors").stat().st_size / 2
    assert _paged_vs_naive(packed, tmp_path) <= MAX_REL_ERR
    a, b = NumpyRunner(packed, num_kv_blocks=16), NumpyRunner(fp32, num_kv_blocks=16)
    batch = ForwardBatch.from_chunks([SeqChunk(list(range(3, 40)), 0, list(range(16)))], 16)
    assert _rel_err(a.execute(batch), b.execute(batch)) <= 1e-5  # the same numbers as the float32 engine
    # the step statistics count the bytes as stored (a GB/s figure that is not inflated 4-8x for 4-bit weights)
    assert StepCost(a.config.arch, a.weight_bytes).weight_bytes == a.weight_bytes < b.weight_bytes / 2
    assert StepCost(b.config.arch, b.weight_bytes).weight_bytes == b.weight_bytes


@pytest.mark.parametrize(("mode", "group"), [("int8", 32), ("int4", 32), ("int4", 64)])
def test_build_time_quantization_is_exact_against_its_blocks(mode: str, group: int, tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", seed=5, hidden_size=128, intermediate_size=256)
    engine = tmp_path / "engine"
    build(str(ckpt), engine, LIMITS, progress=False, weights=WeightPlan(mode, group))
    expected = "int8" if mode == "int8" else f"int4-g{group}+int8"
    assert load_engine_config(engine).weight_format == expected
    assert native_info(EngineCore(engine, num_kv_blocks=8), max_queue=1).weight_format == expected  # GetModelInfo
    assert _paged_vs_naive(engine, tmp_path) <= MAX_REL_ERR


def test_kernel_backends_agree_and_rows_lookup(tmp_path: Path) -> None:
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, seed=1, quant="q4_1", hidden_size=128, intermediate_size=256)
    build(str(gguf), tmp_path / "e", LIMITS, progress=False)
    runner = NumpyRunner(tmp_path / "e", num_kv_blocks=4)
    w = runner.layers[0].gate_up
    rng = np.random.default_rng(0)
    for rows in (1, 3, 9, 64):
        x = rng.standard_normal((rows, w.cols), dtype=np.float32)
        ref = x.astype(np.float64) @ dequantize_packed(w).T.astype(np.float64)
        for path in ("direct", "panel", "blas"):
            assert _rel_err(kernels.matmul(x, w, path=path), ref) <= 1e-6, (rows, path)
            for isa in BACKEND.ext.isas()[1:] if BACKEND.matmul == "c" else ():  # the extension's other paths
                try:
                    BACKEND.ext.force_isa(isa)
                    assert _rel_err(kernels.matmul(x, w, path=path), ref) <= 1e-6, (rows, path, isa)
                finally:
                    BACKEND.ext.force_isa("best")
        fallback = np.empty((rows, w.rows), np.float32)
        kernels.fallback_matmul(x, w, fallback)  # numba where it is installed, else numpy
        assert _rel_err(fallback, ref) <= 1e-6
    ids = np.array([0, 5, 31, 32, 266])
    np.testing.assert_array_equal(dequantize_rows(runner.embed, ids), dequantize_packed(runner.embed)[ids])


def test_ceilings_are_measured_on_default_blas_threads() -> None:
    """A packed engine sets OpenBLAS to 1 thread; the machine's GEMM ceiling must not be measured on that."""
    _, getter = threads._openblas_lib()
    if getter is None:
        pytest.skip("numpy's BLAS is not a findable OpenBLAS")
    before = int(getter())
    try:
        threads.openblas_threads(1)
        with threads.default_blas_threads():
            assert int(getter()) == threads.DEFAULT_BLAS_THREADS
        assert int(getter()) == 1  # the engine's setting is back
    finally:
        threads.openblas_threads(before)
