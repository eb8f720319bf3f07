"""The KV cache's stored types (--kv-cache-dtype, service/engine/kernels/kv_cache.py).

The KV-write kernel converts exactly as kv_cache.encode() does (round to nearest even for float16 / bfloat16,
int8 with a scale per (slot, KV head)); decode and prefill attention reading the stored type directly equal a
float64 softmax over the widened values; the budget, the config and the command line know the types; a float32
cache is what it always was.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from service.__main__ import config_from_args, parse_args
from service.api.llm.servicer import model_info
from service.backends.native import _info as native_info
from service.config import KV_CACHE_DTYPES, NativeConfig
from service.engine.core import EngineCore
from service.engine.kernels.attention import paged_causal_attention
from service.engine.kernels.backend import BACKEND
from service.engine.kernels.kv_cache import KV_FORMATS, KVCache, decode, encode, kv_format
from service.engine.kernels.ops import write_kv
from service.engine.kernels.paged_attention import DecodeAttention
from service.request import GenerateRequest, SamplingParams

needs_ext = pytest.mark.skipif(BACKEND.ext is None, reason="the compiled kernels extension is not built")
H, KV, HD, BS, NB = 4, 2, 32, 8, 12


def awkward_rows(rng: np.random.Generator, T: int) -> np.ndarray:
    """qkv [T, H + 2 KV, HD]: normal values, and the conversions' edge cases (halfway points, float16's
    subnormals and overflow, an all-zero head)."""
    qkv = rng.standard_normal((T, H + 2 * KV, HD), dtype=np.float32) * 3
    edge = np.array([0.0, -0.0, 1e-6, -3e-8, 6e-5, 65504.0, 65519.0, 65520.0, 1e5, 1.0009765625, 1.00048828125,
                     np.float32(1 + 2**-8), np.float32(1 + 3 * 2**-8), 2.5, -2.5, 1e-38], np.float32)  # fmt: skip
    qkv[0, H, : len(edge)] = edge
    qkv[0, H + KV, : len(edge)] = edge[::-1]
    qkv[1, H + 1] = 0.0  # an all-zero K head: int8 scale 0
    return qkv


@needs_ext
@pytest.mark.parametrize("dtype", KV_CACHE_DTYPES)
def test_write_kv_converts_as_encode(dtype: str, kernel_isa) -> None:
    rng = np.random.default_rng(5)
    cache = KVCache(1, NB, BS, KV, HD, dtype)
    kv = cache.layer(0)
    qkv = awkward_rows(rng, 10)
    slots = rng.permutation(NB * BS)[:10].astype(np.int64)
    write_kv(kv, qkv, slots, H)
    for stored, scales, heads in ((kv.k, kv.k_scale, qkv[:, H : H + KV]), (kv.v, kv.v_scale, qkv[:, H + KV :])):
        want, want_scale = encode(heads, kv.fmt)
        got = stored.reshape(-1, KV, HD)[slots]
        assert got.dtype == kv.fmt.storage
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))  # bits, NaN-safe
        if kv.fmt.scaled:
            assert np.array_equal(scales.reshape(-1, KV)[slots], want_scale)
    if dtype == "float16":
        assert np.isinf(kv.k.reshape(-1, KV, HD)[slots[0], 0, 7])  # 65520 rounds to inf
        assert kv.k.reshape(-1, KV, HD)[slots[0], 0, 6] == 65504  # 65519 does not
    if dtype == "int8":
        assert kv.k_scale.reshape(-1, KV)[slots[1], 1] == 0 and not kv.k.reshape(-1, KV, HD)[slots[1], 1].any()


def test_encode_decode_round_trip_errors_are_the_types_own() -> None:
    x = np.random.default_rng(2).standard_normal((64, KV, HD), dtype=np.float32)
    bound = {"float32": 0.0, "float16": 2**-11, "bfloat16": 2**-8, "int8": 0.5 / 127}  # relative to max|x| of a head
    for name, fmt in KV_FORMATS.items():
        stored, scales = encode(x, fmt)
        err = np.abs(decode(stored, scales, fmt) - x) / np.abs(x).max(axis=-1, keepdims=True)
        assert err.max() <= bound[name] * 1.0001, name
        assert (err.max() > 0) == (name != "float32")


def _reference(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """float64 softmax(q k^T) v for one query [H, HD] over widened k, v [n, KV, HD]: [H, HD]."""
    out = np.empty((H, HD))
    for h in range(H):
        s = k[:, h // (H // KV)].astype(np.float64) @ q[h].astype(np.float64)
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ v[:, h // (H // KV)].astype(np.float64)
    return out


@needs_ext
@pytest.mark.parametrize("dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("threads", [0, 1], ids=["pool", "1-thread"])
def test_attention_reads_the_stored_type(dtype: str, threads: int, kernel_isa) -> None:
    """Decode and prefill attention over a float16 / bfloat16 / int8 cache equal float64 attention over the
    values the cache holds (widened): the kernels read the stored type, they do not approximate it further."""
    rng = np.random.default_rng(9)
    cache = KVCache(1, NB, BS, KV, HD, dtype)
    kv = cache.layer(0)
    n = 70  # 9 blocks, a partial last one
    table = rng.permutation(NB)[: -(-n // BS)].astype(np.int64)
    slots = (table[np.arange(n) // BS] * BS + np.arange(n) % BS).astype(np.int64)
    write_kv(kv, awkward_rows(rng, n) / np.float32(1000), slots, H)  # / 1000: no inf in float16
    k, v = kv.dense(table, n)  # [n, KV, HD] float32, widened as the kernels widen
    q = rng.standard_normal((5, H, HD), dtype=np.float32) * 0.3
    attn = DecodeAttention("c")
    dec = attn(q[-1:], kv, attn.prepare([table], np.array([n])), threads)[0]  # [H, HD]
    pre = paged_causal_attention(q, kv, table, n, threads).reshape(5, H, HD)
    for i, out in ((4, dec), *((i, pre[i]) for i in range(5))):
        ref = _reference(q[i], k[: n - 4 + i], v[: n - 4 + i])
        assert np.abs(out - ref).max() <= 2e-6 * max(1.0, np.abs(ref).max()), (dtype, i)


def test_budget_and_config_know_the_types() -> None:
    assert NativeConfig().kv_cache_dtype == "float32"
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*'int4'"):
        NativeConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_format("fp16")
    per_slot = {name: fmt.bytes_per_slot(3, 64) for name, fmt in KV_FORMATS.items()}
    assert per_slot == {"float32": 768, "float16": 384, "bfloat16": 384, "int8": 3 * (64 + 4)}
    cache = KVCache(2, 3, 4, 3, 64, "int8")
    assert cache.nbytes == 2 * 2 * 3 * 4 * per_slot["int8"]
    assert cache.k.dtype == np.int8 and cache.k_scale.shape == (2, 3, 4, 3)


def test_the_flag_reaches_the_config_and_a_bad_value_names_it(capsys: pytest.CaptureFixture) -> None:
    cfg = config_from_args(parse_args(["--engine", "e", "--kv-cache-dtype", "bfloat16"]))
    assert cfg.backend.native.kv_cache_dtype == "bfloat16"
    assert config_from_args(parse_args(["--engine", "e"])).backend.native.kv_cache_dtype == "float32"
    with pytest.raises(SystemExit) as exc:
        parse_args(["--engine", "e", "--kv-cache-dtype", "fp8"])
    assert exc.value.code == 2
    assert "argument --kv-cache-dtype: invalid choice: 'fp8'" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", KV_CACHE_DTYPES)
def test_engine_budget_and_model_info_name_the_type(tiny_engine_dir, dtype: str) -> None:
    """The same KV budget holds 2x the float32 blocks in float16 / bfloat16 and about 4x in int8 (scales
    included); GetModelInfo names the type the engine runs with."""
    core = EngineCore(tiny_engine_dir, kv_cache_memory="4MiB", kv_cache_dtype=dtype)
    float32 = EngineCore(tiny_engine_dir, kv_cache_memory="4MiB")
    assert core.runner.kv_cache.k.dtype == KV_FORMATS[dtype].storage
    arch = core.config.arch
    ratio = KV_FORMATS["float32"].bytes_per_slot(arch.num_key_value_heads, arch.head_dim) / KV_FORMATS[
        dtype
    ].bytes_per_slot(arch.num_key_value_heads, arch.head_dim)
    assert core.sched_cfg.num_kv_blocks == pytest.approx(float32.sched_cfg.num_kv_blocks * ratio, abs=1)
    assert core.runner.kv_cache.nbytes <= 4 * 2**20
    info = native_info(core, max_queue=1)
    assert info.kv_cache_dtype == dtype
    assert model_info(SimpleNamespace(info=info, tokenizer=core.tokenizer), 8).kv_cache_dtype == dtype


def test_greedy_tokens_of_a_narrow_cache_run_end_to_end(tiny_engine_dir) -> None:
    """Prefill chunks and decodes through the engine with each type: the requests finish with their tokens."""
    outs = {}
    for dtype in KV_CACHE_DTYPES:
        core = EngineCore(tiny_engine_dir, num_kv_blocks=32, kv_cache_dtype=dtype, max_num_batched_tokens=16)
        prompt = list(range(3, 60))
        gen = GenerateRequest("r", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        outs[dtype] = [t for o in core.generate([gen])["r"] for t in o.new_token_ids]
    assert all(len(t) == 8 for t in outs.values())
    assert outs["float16"] == outs["float32"]  # the tiny model's margins are wide enough for float16
