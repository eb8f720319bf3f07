"""What every model input (GGUF file, Hugging Face directory, tiny-random) is turned into before conversion.

Tensors are exposed under Hugging Face Llama names, in Hugging Face layout ([out_features, in_features]),
as float32, with rotate-half ("NeoX") RoPE ordering of the Q/K rows. Each input's quirks (GGUF's permuted
Q/K rows, bfloat16 shards, ...) are undone by its own loader, so the conversion sees one shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from build_engine.spec import ModelArch


class BuildError(Exception):
    """A problem with the build's input or output; the CLI prints it on one line and exits 2."""


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    bos_token: str | None
    eos_token: str | None
    unk_token: str | None
    pad_token: str | None
    add_bos_token: bool


@dataclass(slots=True)
class ModelSource:
    name: str  # engine model_name
    arch: ModelArch
    get_tensor: Callable[[str], np.ndarray]  # HF name -> float32 array in HF layout
    tensor_names: frozenset[str]
    tokenizer_json: str  # serialized `tokenizers.Tokenizer`
    special_tokens: SpecialTokens
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    chat_template: str | None
    info: dict[str, Any] = field(default_factory=dict)  # recorded as config.json "source"
    # HF name -> (raw uint8 blocks [rows, n_blocks * block_bytes], "q4_0" | "q4_1" | "q8_0") for tensors stored
    # in a block format the native kernels read, with the same row order as get_tensor; None otherwise
    get_raw: Callable[[str], tuple[np.ndarray, str] | None] | None = None


def layer_tensor_names(i: int) -> dict[str, str]:
    prefix = f"model.layers.{i}."
    return {
        "attn_norm": prefix + "input_layernorm.weight",
        "q": prefix + "self_attn.q_proj.weight",
        "k": prefix + "self_attn.k_proj.weight",
        "v": prefix + "self_attn.v_proj.weight",
        "o": prefix + "self_attn.o_proj.weight",
        "ffn_norm": prefix + "post_attention_layernorm.weight",
        "gate": prefix + "mlp.gate_proj.weight",
        "up": prefix + "mlp.up_proj.weight",
        "down": prefix + "mlp.down_proj.weight",
    }


EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
ROPE_FREQ_FACTORS = "rope_freq_factors"


def expected_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    d, f, v = arch.hidden_size, arch.intermediate_size, arch.vocab_size
    shapes: dict[str, tuple[int, ...]] = {EMBED: (v, d), FINAL_NORM: (d,)}
    if not arch.tie_word_embeddings:
        shapes[LM_HEAD] = (v, d)
    if arch.rope_freq_factors:
        shapes[ROPE_FREQ_FACTORS] = (arch.head_dim // 2,)
    for i in range(arch.num_hidden_layers):
        n = layer_tensor_names(i)
        shapes.update(
            {
                n["attn_norm"]: (d,),
                n["q"]: (arch.q_size, d),
                n["k"]: (arch.kv_size, d),
                n["v"]: (arch.kv_size, d),
                n["o"]: (d, arch.q_size),
                n["ffn_norm"]: (d,),
                n["gate"]: (f, d),
                n["up"]: (f, d),
                n["down"]: (d, f),
            }
        )
    return shapes


def check_tensors(source: ModelSource) -> None:
    """Every tensor the architecture needs is present, before any slow conversion starts."""
    missing = [n for n in expected_shapes(source.arch) if n not in source.tensor_names]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise BuildError(f"input is missing tensors: {', '.join(missing[:3])}{more}")
