"""GetTokenizer's bundle: a Hugging Face-format tokenizer directory as one zip, assembled at serve time from the
engine directory's own files (so every engine already built serves one, and nothing can drift from what the
server tokenizes with).

Entries (what a gateway loading a Hugging Face tokenizer directory reads, smg among them):
- tokenizer.json: the engine's, as is;
- tokenizer_config.json: the engine's special tokens plus `chat_template`, `model_max_length` and the
  tokenizer class;
- chat_template.jinja: the engine's chat template, when the model has one;
- config.json, generation_config.json: Hugging Face format, with the model's EOS / BOS ids (the engine's own
  config.json is our format, so it cannot be this one).
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

from build_engine import spec
from service.backends.base import BackendInfo
from service.tokenizer import Tokenizer

CHUNK_BYTES = 1 << 20  # the zip goes out in pieces of this size (under any sane message limit)


@dataclass(frozen=True, slots=True)
class Bundle:
    data: bytes  # the zip
    sha256: str  # lowercase hex of the whole zip

    def chunks(self) -> list[bytes]:
        return [self.data[i : i + CHUNK_BYTES] for i in range(0, len(self.data), CHUNK_BYTES)] or [b""]


def _hf_config(info: BackendInfo, ids: spec.TokenizerIds) -> dict:
    eos = list(ids.eos_token_ids)
    config = {
        "architectures": [info.architecture],
        "vocab_size": info.vocab_size,
        "hidden_size": info.hidden_size,
        "num_hidden_layers": info.num_layers,
        "num_attention_heads": info.num_attention_heads,
        "num_key_value_heads": info.num_key_value_heads,
        "max_position_embeddings": info.max_seq_len,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
    }
    for key in ("bos_token_id", "pad_token_id"):
        if getattr(ids, key) is not None:
            config[key] = getattr(ids, key)
    return config


def build(engine_dir: str | Path, info: BackendInfo, tokenizer: Tokenizer) -> Bundle:
    """The zip of the engine's tokenizer, in Hugging Face format (reads the engine directory: run it off the loop)."""
    engine_dir = Path(engine_dir)
    config = _hf_config(info, spec.load_engine_config(engine_dir).tokenizer)
    generation = {key: config[key] for key in ("eos_token_id", "bos_token_id", "pad_token_id") if key in config}
    tok_config = {
        **tokenizer.special,
        "model_max_length": info.max_seq_len,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if tokenizer.chat_template is not None:
        tok_config["chat_template"] = tokenizer.chat_template
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.write(engine_dir / spec.TOKENIZER_FILE, spec.TOKENIZER_FILE)
        z.writestr("tokenizer_config.json", json.dumps(tok_config, indent=2, ensure_ascii=False))
        if tokenizer.chat_template is not None:
            z.writestr(spec.CHAT_TEMPLATE_FILE, tokenizer.chat_template)
        z.writestr("config.json", json.dumps(config, indent=2))
        z.writestr("generation_config.json", json.dumps(generation, indent=2))
    data = buf.getvalue()
    return Bundle(data, hashlib.sha256(data).hexdigest())
