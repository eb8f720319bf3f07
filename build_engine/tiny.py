"""tiny-random: a seeded few-layer Llama with a small byte-level vocabulary, for fast tests. No downloads.

It is written as an ordinary Hugging Face checkpoint directory, so building it exercises the same path as a
user's checkpoint; tests also vary its shape (tied/untied embeddings, head counts, bfloat16 weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from build_engine.source import EMBED, FINAL_NORM, LM_HEAD, layer_tensor_names

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = (("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s"))
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def bytes_to_unicode() -> list[str]:
    """GPT-2's byte alphabet: the printable character that stands for each byte 0..255 in byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def tiny_tokenizer() -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in bytes_to_unicode():
        vocab[ch] = len(vocab)
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=list(MERGES)))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{N}"), "isolated"), byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tokenizer


def tiny_config(
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 1024,
    rope_theta: float = 10000.0,
) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(SPECIAL_TOKENS) + 256 + len(MERGES),
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": hidden_size // num_attention_heads,
        "rope_theta": rope_theta,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "torch_dtype": "float32",
    }


def tiny_weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """Seeded weights in Hugging Face layout ([out, in]); norms near 1 so that folding them is exercised."""
    rng = np.random.default_rng(seed)
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def linear(out_features: int, in_features: int) -> np.ndarray:
        return (rng.standard_normal((out_features, in_features)) / np.sqrt(in_features)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)

    weights = {EMBED: rng.standard_normal((v, d)).astype(np.float32), FINAL_NORM: norm()}
    for i in range(cfg["num_hidden_layers"]):
        n = layer_tensor_names(i)
        weights[n["attn_norm"]], weights[n["ffn_norm"]] = norm(), norm()
        weights[n["q"]], weights[n["k"]], weights[n["v"]] = linear(q, d), linear(kv, d), linear(kv, d)
        weights[n["o"]] = linear(d, q)
        weights[n["gate"]], weights[n["up"]], weights[n["down"]] = linear(f, d), linear(f, d), linear(d, f)
    if not cfg["tie_word_embeddings"]:
        weights[LM_HEAD] = linear(v, d)
    return weights


def write_tiny_checkpoint(out_dir: str | Path, seed: int = 0, **config_overrides: object) -> Path:
    """Write a tiny Llama as a Hugging Face checkpoint directory (config.json, model.safetensors, tokenizer)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(**config_overrides)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    save_file(tiny_weights(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    tiny_tokenizer().save(str(out / "tokenizer.json"))
    tok_cfg = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, sort_keys=True))
    return out
