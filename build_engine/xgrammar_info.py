"""An engine's tokenizer as xgrammar takes it (the grammar engine of TensorRT-LLM's guided decoding).

Two readers take the same three values:
- the service's trtllm backend: `GuidedDecodingConfig(backend=XGRAMMAR, encoded_vocab=..., tokenizer_str=...,
  stop_token_ids=...)` (tensorrt_llm.bindings.executor, 1.2; names in tests/data/trtllm_surface_1.2.json);
- Triton's TensorRT-LLM C++ backend: the JSON file named by the tensorrt_llm model's `xgrammar_tokenizer_info_path`
  parameter, which `ModelInstanceState::getGuidedDecodingConfigFromParams` (model_instance_state.cc) reads with
  `tokenizerInfo["encoded_vocab"]`, `["tokenizer_str"]` and `["stop_token_ids"]` into that same
  GuidedDecodingConfig. TensorRT-LLM writes it with `examples/generate_xgrammar_tokenizer_info.py`
  (`json.dump(_xgrammar_tokenizer_info(tokenizer))`, tensorrt_llm/llmapi/tokenizer.py): `encoded_vocab` is the
  vocabulary's token strings in id order, `tokenizer_str` the Hugging Face tokenizer.json text (xgrammar reads the
  vocabulary type, byte-level or byte-fallback, from it), `stop_token_ids` the EOS ids. There is no separate
  vocab-type key in that format.

Two differences from TensorRT-LLM's writer, both deliberate: `stop_token_ids` holds every EOS id of the engine
(its writer takes only `tokenizer.eos_token_id`; an engine with several EOS ids would otherwise have a grammar
that never lets the others end), and an id missing from the vocabulary is an empty string at its place (its
writer sorts the tokens, so a gap would shift every later token onto the wrong id).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import tokenizers

from build_engine import spec

TOKENIZER_INFO_FILE = "xgrammar_tokenizer_info.json"  # generate_xgrammar_tokenizer_info.py's file name


@dataclass(frozen=True, slots=True)
class XgrammarTokenizerInfo:
    encoded_vocab: tuple[str, ...]  # token id -> the token as the vocabulary spells it ("" for an unused id)
    tokenizer_str: str  # tokenizer.json's text
    stop_token_ids: tuple[int, ...]  # the engine's EOS ids

    def as_json(self) -> dict:
        """The xgrammar_tokenizer_info_path file's object (the three keys the C++ backend reads)."""
        return {
            "encoded_vocab": list(self.encoded_vocab),
            "tokenizer_str": self.tokenizer_str,
            "stop_token_ids": list(self.stop_token_ids),
        }

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(self.as_json(), ensure_ascii=False))
        return path


def encoded_vocab(tokenizer: tokenizers.Tokenizer) -> tuple[str, ...]:
    """The token strings in id order, added tokens included; an id no token has is ""."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    size = max(vocab.values(), default=-1) + 1
    out = [""] * size
    for token, token_id in vocab.items():
        out[token_id] = token
    return tuple(out)


def tokenizer_info(engine_dir: str | Path, eos_token_ids: Sequence[int]) -> XgrammarTokenizerInfo:
    """From an engine directory's tokenizer.json and its EOS ids (EngineConfig.tokenizer.eos_token_ids)."""
    text = (Path(engine_dir) / spec.TOKENIZER_FILE).read_text()
    return XgrammarTokenizerInfo(encoded_vocab(tokenizers.Tokenizer.from_str(text)), text, tuple(eos_token_ids))
