"""Test helpers that write model files in other formats (GGUF, bfloat16 and sharded safetensors)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from build_engine import tensor_io
from build_engine.tensor_io import SafetensorsFile
from build_engine.tiny import CHAT_TEMPLATE, MERGES, SPECIAL_TOKENS, bytes_to_unicode, tiny_config, tiny_weights

GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q/K rows (rotate-half halves -> interleaved pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{GGUF_LAYER_NAMES[rest.removesuffix('.weight')]}.weight"


def write_tiny_gguf(
    path: Path, seed: int = 0, arch: str = "llama", quant: str | None = None, **overrides: object
) -> dict[str, np.ndarray]:
    """The tiny model as a GGUF file written the way llama.cpp's converter writes one; returns HF weights.

    quant ("q4_0", "q4_1", "q8_0"): every matrix (embedding included) stored in that block format, as
    llama.cpp's quantize tool would; the returned weights are then the dequantized values.
    """
    cfg = tiny_config(**overrides)
    weights = tiny_weights(cfg, seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["head_dim"])
    tokens = list(SPECIAL_TOKENS) + bytes_to_unicode() + [a + b for a, b in MERGES]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS)))
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, hf_tensor in weights.items():
        tensor = hf_tensor
        if name.endswith("q_proj.weight"):
            tensor = llama_cpp_permute(hf_tensor, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            tensor = llama_cpp_permute(hf_tensor, cfg["num_key_value_heads"])
        tensor = np.ascontiguousarray(tensor, dtype=np.float32)
        if quant is not None and tensor.ndim == 2:
            qtype = gguf.GGMLQuantizationType[quant.upper()]
            blocks = gguf.quants.quantize(tensor, qtype)
            w.add_tensor(_gguf_name(name), blocks, raw_shape=blocks.shape, raw_dtype=qtype)
            weights[name] = gguf.quants.dequantize(blocks, qtype).reshape(hf_tensor.shape)
            if name.endswith(("q_proj.weight", "k_proj.weight")):  # dequantized in the permuted order: undo
                heads = cfg["num_attention_heads"] if name.endswith("q_proj.weight") else cfg["num_key_value_heads"]
                from build_engine.gguf_source import unpermute_qk

                weights[name] = unpermute_qk(weights[name], heads)
            continue
        w.add_tensor(_gguf_name(name), tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], bf16: bool = False) -> None:
    """bfloat16 is truncated here (not rounded), so tests can predict the values exactly."""
    if not bf16:
        return tensor_io.write_safetensors(path, tensors, "float32")
    truncated = {k: (np.ascontiguousarray(v, np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
                 for k, v in tensors.items()}  # fmt: skip
    tensor_io.write_safetensors(path, truncated, "bfloat16")


def rewrite_checkpoint(src: Path, dst: Path, bf16: bool = False, shards: int = 1) -> dict[str, np.ndarray]:
    """Copy a checkpoint directory, re-saving its weights as bfloat16 and/or split across shards."""
    dst.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    f = SafetensorsFile(src / "model.safetensors")
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    names = sorted(tensors)
    for i in range(shards):
        part = {k: tensors[k] for k in names[i::shards]}
        write_safetensors(dst / f"model-{i + 1:05d}-of-{shards:05d}.safetensors", part, bf16=bf16)
    return tensors
