"""Rebuild a Hugging Face `tokenizers` tokenizer from GGUF tokenizer metadata.

Only byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`, used by SmolLM, Llama 3, Qwen, ...) are
supported. The pre-tokenizer follows llama.cpp's `tokenizer.ggml.pre` type, because llama.cpp derives it
from the model's original tokenizer:
  - "smollm": every numeric character is isolated, then the GPT-2 split. This is what SmolLM2's own
    tokenizer.json does; transformers' GGUF loader has no entry for it and falls back to plain GPT-2, which
    differs only on whitespace runs before digits (see docs/engine.md).
  - "llama-bpe" / "llama3": the Llama 3 split regex.
  - "gpt2", "default" or absent: the GPT-2 split.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


class UnsupportedTokenizer(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class GGUFVocab:
    model: str  # tokenizer.ggml.model
    pre: str | None  # tokenizer.ggml.pre
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    add_bos_token: bool
    bos_token_id: int | None


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in (None, "gpt2", "default"):
        return byte_level
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{N}"), "isolated"), byte_level])
    if pre in ("llama-bpe", "llama3"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
            ]
        )
    raise UnsupportedTokenizer(
        f"GGUF pre-tokenizer type {pre!r} is not supported (supported: smollm, llama-bpe, gpt2); "
        "build from the Hugging Face checkpoint directory instead"
    )


def build_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    if vocab.model != "gpt2":
        raise UnsupportedTokenizer(
            f"GGUF tokenizer model {vocab.model!r} is not supported (only byte-level BPE 'gpt2'); "
            "build from the Hugging Face checkpoint directory instead"
        )
    token_to_id = {token: i for i, token in enumerate(vocab.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    tokenizer = Tokenizer(models.BPE(vocab=token_to_id, merges=merges, dropout=None, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(vocab.pre)
    tokenizer.decoder = decoders.ByteLevel()
    control = [i for i, t in enumerate(vocab.token_types) if t == TOKEN_TYPE_CONTROL]
    user = [i for i, t in enumerate(vocab.token_types) if t == TOKEN_TYPE_USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(vocab.tokens[i], special=True, normalized=False) for i in control])
    tokenizer.add_tokens([AddedToken(vocab.tokens[i], special=False, normalized=False) for i in user])
    if vocab.add_bos_token and vocab.bos_token_id is not None:
        bos = vocab.tokens[vocab.bos_token_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab.bos_token_id)]
        )
    return tokenizer
