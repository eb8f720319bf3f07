"""Export any model input (GGUF file, HF directory, tiny-random) as a Hugging Face LlamaForCausalLM checkpoint.

`python -m build_engine --model M --output DIR --format hf [--dtype float32|float16|bfloat16]`. This is how a
GGUF (the default model) reaches TensorRT-LLM, whose LLaMAForCausalLM.from_hugging_face reads HF directories,
and a way for anyone to get a GGUF's weights into transformers. The tensors are exactly what the native
engine is built from (GGUF blocks dequantized, llama.cpp's Q/K row permutation undone), so every consumer
sees the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from build_engine.convert import checked_tensor
from build_engine.source import EMBED, LM_HEAD, BuildError, ModelSource, expected_shapes
from build_engine.tensor_io import WRITE_DTYPES, write_safetensors

WEIGHTS_FILE = "model.safetensors"


def hf_config(source: ModelSource, dtype: str) -> dict:
    a = source.arch
    if a.rope_freq_factors:
        raise BuildError(
            "this model uses per-frequency RoPE factors (GGUF rope_freqs), which a Hugging Face config can only "
            "express as its original rope_scaling parameters; export from the original checkpoint instead"
        )
    eos = list(source.eos_token_ids)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_hidden_layers": a.num_hidden_layers,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads,
        "head_dim": a.head_dim,
        "hidden_act": "silu",
        "rope_theta": a.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": a.rms_norm_eps,
        "max_position_embeddings": a.max_position_embeddings,
        "tie_word_embeddings": a.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": source.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": source.pad_token_id,
        "torch_dtype": dtype,
    }


def tokenizer_config(source: ModelSource, max_len: int) -> dict:
    st = source.special_tokens
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": st.bos_token,
        "eos_token": st.eos_token,
        "unk_token": st.unk_token,
        "pad_token": st.pad_token,
        "add_bos_token": st.add_bos_token,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
    }
    if source.chat_template:
        cfg["chat_template"] = source.chat_template
    return cfg


def export_hf(source: ModelSource, out: Path, dtype: str = "float32") -> None:
    """Write the checkpoint files into an existing, empty directory `out`."""
    if dtype not in WRITE_DTYPES:
        raise BuildError(f"--dtype {dtype} cannot be exported (choose from {', '.join(WRITE_DTYPES)})")
    config = hf_config(source, dtype)
    shapes = expected_shapes(source.arch)
    names = [n for n in shapes if n != LM_HEAD or not source.arch.tie_word_embeddings]
    tensors = {name: checked_tensor(source, name, shapes) for name in names}
    if EMBED not in tensors:
        raise BuildError("the model has no token embedding")
    write_safetensors(out / WEIGHTS_FILE, tensors, dtype)
    del tensors
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "tokenizer.json").write_text(source.tokenizer_json)
    tok_cfg = tokenizer_config(source, source.arch.max_position_embeddings)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
    if source.chat_template:
        (out / "chat_template.jinja").write_text(source.chat_template)
    gen = {"bos_token_id": source.bos_token_id, "eos_token_id": config["eos_token_id"],
           "pad_token_id": source.pad_token_id}  # fmt: skip
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
