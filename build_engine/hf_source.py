"""Hugging Face checkpoint input: a LlamaForCausalLM directory (config.json, *.safetensors, tokenizer.json)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from build_engine.source import LM_HEAD, ROPE_FREQ_FACTORS, BuildError, ModelSource, SpecialTokens
from build_engine.spec import ModelArch, sha256_file
from build_engine.tensor_io import SafetensorsFile, TensorFileError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BuildError(f"cannot read {path}: {exc}") from exc


def llama3_freq_factors(head_dim: int, theta: float, scaling: dict[str, Any]) -> np.ndarray:
    """Per-frequency divisors equivalent to transformers' "llama3" rope scaling (same meaning as GGUF rope_freqs)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [head_dim // 2]
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    scaled = np.where(medium, smoothed, scaled)
    return (inv_freq / scaled).astype(np.float32)


def _rope_factors(cfg: dict[str, Any], head_dim: int) -> np.ndarray | None:
    scaling = cfg.get("rope_scaling")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return None
    if kind == "linear":
        return np.full(head_dim // 2, scaling["factor"], dtype=np.float32)
    if kind == "llama3":
        return llama3_freq_factors(head_dim, float(cfg.get("rope_theta", 10000.0)), scaling)
    raise BuildError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3)")


def _arch(cfg: dict[str, Any], has_lm_head: bool, has_factors: bool) -> ModelArch:
    archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise BuildError(f"unsupported architecture {archs[0]!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise BuildError(f"config.json sets {flag}=true, which is not supported")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    return ModelArch(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)) or not has_lm_head,
        rope_freq_factors=has_factors,
    )


def _weight_files(model_dir: Path) -> dict[str, SafetensorsFile]:
    """tensor name -> the open file holding it (single file, sharded with an index, or any *.safetensors)."""
    paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise BuildError(f"no *.safetensors files in {model_dir}")
    by_name: dict[str, SafetensorsFile] = {}
    for path in paths:
        try:
            f = SafetensorsFile(path)
        except (TensorFileError, OSError) as exc:
            raise BuildError(str(exc)) from exc
        for key in f.keys():
            by_name[key] = f
    return by_name


def _token_str(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _eos_ids(cfg: dict[str, Any], model_dir: Path) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [cfg]
    if (model_dir / "generation_config.json").is_file():
        sources.append(_read_json(model_dir / "generation_config.json"))
    for doc in sources:
        value = doc.get("eos_token_id")
        for i in value if isinstance(value, list) else [value]:
            if i is not None and i not in ids:
                ids.append(int(i))
    return tuple(ids)


def _checksums(paths: list[Path]) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in paths}


def load_hf_dir(model_dir: Path, name: str) -> ModelSource:
    for required in ("config.json", "tokenizer.json"):
        if not (model_dir / required).is_file():
            raise BuildError(f"{model_dir / required} is missing (a Hugging Face checkpoint needs it)")
    cfg = _read_json(model_dir / "config.json")
    files = _weight_files(model_dir)
    factors = _rope_factors(cfg, int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]))
    try:
        arch = _arch(cfg, LM_HEAD in files, factors is not None)
    except KeyError as exc:
        raise BuildError(f"config.json is missing {exc}") from exc

    def get_tensor(hf_name: str) -> np.ndarray:
        if hf_name == ROPE_FREQ_FACTORS:
            return factors
        try:
            return files[hf_name].get(hf_name)
        except TensorFileError as exc:
            raise BuildError(str(exc)) from exc

    tok_cfg_path = model_dir / "tokenizer_config.json"
    tok_cfg = _read_json(tok_cfg_path) if tok_cfg_path.is_file() else {}
    template = tok_cfg.get("chat_template")
    if (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    tokenizer_json = (model_dir / "tokenizer.json").read_text()
    vocab = json.loads(tokenizer_json)
    token_ids = {t["content"]: t["id"] for t in vocab.get("added_tokens", [])}
    bos = _token_str(tok_cfg.get("bos_token"))
    pad = _token_str(tok_cfg.get("pad_token"))
    names = set(files) | ({ROPE_FREQ_FACTORS} if factors is not None else set())
    return ModelSource(
        name=name,
        arch=arch,
        get_tensor=get_tensor,
        tensor_names=frozenset(names),
        tokenizer_json=tokenizer_json,
        special_tokens=SpecialTokens(
            bos_token=bos,
            eos_token=_token_str(tok_cfg.get("eos_token")),
            unk_token=_token_str(tok_cfg.get("unk_token")),
            pad_token=pad,
            add_bos_token=bool(tok_cfg.get("add_bos_token", False)),
        ),
        bos_token_id=cfg.get("bos_token_id", token_ids.get(bos)),
        eos_token_ids=_eos_ids(cfg, model_dir),
        pad_token_id=cfg.get("pad_token_id", token_ids.get(pad)),
        chat_template=template,
        info={"kind": "hf", "dir": model_dir.name, "sha256": _checksums(sorted({f.path for f in files.values()}))},
    )
