"""The engine directory contract between build_engine/ and service/.

An engine directory holds:
  config.json            EngineConfig below (format name + version, architecture, build limits, tokenizer ids)
  model.safetensors      weights already in the runner's layout (see build_engine/convert.py)
  tokenizer.json         Hugging Face `tokenizers` format
  tokenizer_config.json  special tokens and add_bos_token, as transformers names them
  chat_template.jinja    the model's chat template (absent if the model has none)
  manifest.json          sha256 and size of every other file

Readers reject an unknown format or a newer format_version instead of guessing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT_NAME = "llm-grpc-serving/engine"
FORMAT_VERSION = 2  # 2: weights may be packed quantized blocks (model.safetensors metadata "packed")
READABLE_VERSIONS = (1, 2)  # 1: every weight fp32 with the norm gains folded in (read as such)
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
MANIFEST_FILE = "manifest.json"
# activation/weight dtypes each backend builds: the numpy engine is float32; TensorRT-LLM runs half precision
BACKEND_DTYPES = {"native": ("float32",), "trtllm": ("float16", "bfloat16")}
SUPPORTED_DTYPES = tuple(dict.fromkeys(d for dtypes in BACKEND_DTYPES.values() for d in dtypes))
# the jinja2 environment chat_template.jinja is rendered in (transformers' options); what parses in it is valid
CHAT_TEMPLATE_ENV = {"trim_blocks": True, "lstrip_blocks": True, "extensions": ["jinja2.ext.loopcontrols"]}


class EngineFormatError(ValueError):
    """The engine directory is missing, corrupt, or of a format this code does not read."""


@dataclass(frozen=True, slots=True)
class ModelArch:
    """Llama-family hyperparameters, named as in Hugging Face's LlamaConfig."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # True when model.safetensors carries "rope_freq_factors" [head_dim // 2] (Llama 3 style rope scaling)
    rope_freq_factors: bool = False
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if getattr(self, name) <= 0:
                raise EngineFormatError(f"architecture.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise EngineFormatError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise EngineFormatError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count as the model defines it (tied embeddings counted once)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else v * d
        return v * d + self.num_hidden_layers * per_layer + d + head


@dataclass(frozen=True, slots=True)
class BuildLimits:
    """What the engine was built for; the service enforces these."""

    max_batch_size: int = 64  # sequences in one step
    max_num_tokens: int = 512  # tokens in one step (prefill chunks + decodes)
    max_seq_len: int = 2048  # prompt + generated tokens of one request
    kv_block_size: int = 16  # tokens per KV cache block
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_num_tokens", "max_seq_len", "kv_block_size"):
            if getattr(self, name) <= 0:
                raise EngineFormatError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_num_tokens < self.max_batch_size:
            raise EngineFormatError(
                f"max_num_tokens ({self.max_num_tokens}) must be >= max_batch_size ({self.max_batch_size}) "
                "so every running sequence can decode in one step"
            )
        if self.dtype not in SUPPORTED_DTYPES:
            raise EngineFormatError(f"dtype {self.dtype!r} is not supported (choose from {SUPPORTED_DTYPES})")


@dataclass(frozen=True, slots=True)
class TokenizerIds:
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # generation stops at any of these
    pad_token_id: int | None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_name: str
    arch: ModelArch
    limits: BuildLimits
    tokenizer: TokenizerIds
    backend: str = "native"
    source: dict[str, Any] = field(default_factory=dict)  # where the weights came from (kind, name, sha256)
    # how the matrices are stored: "float32", or the packed block formats ("q4_1+q8_0", "int8", "int4-g32")
    weight_format: str = "float32"

    def to_json(self) -> str:
        doc = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "backend": self.backend,
            "weight_format": self.weight_format,
            "model_name": self.model_name,
            "architecture": dataclasses.asdict(self.arch),
            "build": dataclasses.asdict(self.limits),
            "tokenizer": {**dataclasses.asdict(self.tokenizer), "eos_token_ids": list(self.tokenizer.eos_token_ids)},
            "source": self.source,
        }
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise EngineFormatError(f"{CONFIG_FILE} is not valid JSON: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise EngineFormatError(f"{CONFIG_FILE} is not an engine config (format={found!r})")
        version = doc.get("format_version")
        if version not in READABLE_VERSIONS:
            raise EngineFormatError(
                f"engine format_version {version} is not supported by this code (reads {FORMAT_VERSION}); rebuild it"
            )
        try:
            tok = doc["tokenizer"]
            return cls(
                model_name=doc["model_name"],
                arch=ModelArch(**doc["architecture"]),
                limits=BuildLimits(**doc["build"]),
                tokenizer=TokenizerIds(
                    bos_token_id=tok["bos_token_id"],
                    eos_token_ids=tuple(tok["eos_token_ids"]),
                    pad_token_id=tok["pad_token_id"],
                ),
                backend=doc.get("backend", "native"),
                source=doc.get("source", {}),
                weight_format=doc.get("weight_format", "float32"),
            )
        except (KeyError, TypeError) as exc:
            raise EngineFormatError(f"{CONFIG_FILE} is missing or has a malformed field: {exc}") from exc


@dataclass(frozen=True, slots=True)
class TrtllmBuildConfig:
    """What a TensorRT-LLM engine was built for, from TensorRT-LLM's own config.json ("build_config") in an
    engine directory of `python -m build_engine --backend trtllm`: the executor refuses what exceeds these."""

    max_input_len: int  # the longest prompt
    max_seq_len: int  # prompt + output tokens
    max_num_tokens: int  # tokens in one step (a whole prompt, without chunked context)
    max_batch_size: int


def load_trtllm_build_config(engine_dir: str | Path) -> TrtllmBuildConfig:
    """TensorRT-LLM's build_config of a trtllm engine directory, or EngineFormatError naming the file."""
    path = Path(engine_dir) / CONFIG_FILE
    try:
        build = json.loads(path.read_text())["build_config"]
        return TrtllmBuildConfig(**{f.name: int(build[f.name]) for f in dataclasses.fields(TrtllmBuildConfig)})
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EngineFormatError(f"{path} is not readable TensorRT-LLM engine config: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineFormatError(f"{path} has no usable build_config ({type(exc).__name__}: {exc})") from None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_engine_config(engine_dir: str | Path, verify: bool = False) -> EngineConfig:
    """Our EngineConfig of an engine directory, whatever its backend: config.json of a native engine, the
    manifest's copy ("engine") of a TensorRT-LLM one; with verify=True every manifest checksum is checked first.

    Checks of the contents (tensor shapes, tokenizer, chat template) are build_engine.verify's."""
    engine_dir = Path(engine_dir)
    backend = engine_backend(engine_dir)
    if verify:
        verify_manifest(engine_dir)
    if backend == "native":
        config_path = engine_dir / CONFIG_FILE
        if not config_path.is_file():
            raise EngineFormatError(f"{config_path} is missing: not an engine directory")
        return EngineConfig.from_json(config_path.read_text())
    engine = read_manifest(engine_dir).get("engine")
    if not isinstance(engine, dict):
        raise EngineFormatError(f"{engine_dir / MANIFEST_FILE} of a {backend} engine has no engine config")
    return EngineConfig.from_json(json.dumps(engine))


def engine_backend(engine_dir: str | Path) -> str:
    """The backend an engine directory was built for: manifest.json's "backend" (every engine since the
    TensorRT-LLM backend), else config.json's (native engines)."""
    engine_dir = Path(engine_dir)
    if not engine_dir.is_dir():
        raise EngineFormatError(f"engine directory {engine_dir} does not exist")
    for name in (MANIFEST_FILE, CONFIG_FILE):
        try:
            doc = json.loads((engine_dir / name).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(doc, dict) and isinstance(doc.get("backend"), str):
            return doc["backend"]
    if (engine_dir / CONFIG_FILE).is_file():
        return "native"
    raise EngineFormatError(f"{engine_dir} is not an engine directory (no {MANIFEST_FILE} or {CONFIG_FILE})")


def read_manifest(engine_dir: Path) -> dict[str, Any]:
    """manifest.json as a dict, or EngineFormatError naming the file."""
    path = engine_dir / MANIFEST_FILE
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise EngineFormatError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EngineFormatError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise EngineFormatError(f"{path} is not a JSON object")
    return doc


def verify_manifest(engine_dir: Path) -> None:
    """Every file the manifest lists is there, with its size and sha256 (the size first: it costs nothing)."""
    manifest_path = engine_dir / MANIFEST_FILE
    files = read_manifest(engine_dir).get("files")
    if not isinstance(files, dict):
        raise EngineFormatError(f'{manifest_path} has no "files" table')
    for name, entry in files.items():
        path = engine_dir / name
        if not path.is_file():
            raise EngineFormatError(f"{path} is listed in {manifest_path} but missing")
        try:
            size, digest = int(entry["bytes"]), str(entry["sha256"])
        except (KeyError, TypeError, ValueError):
            raise EngineFormatError(f"{manifest_path}: the entry of {name} has no bytes and sha256") from None
        if path.stat().st_size != size:
            raise EngineFormatError(
                f"{path} does not match {manifest_path}: {path.stat().st_size} bytes, {size} expected (truncated or "
                "edited)"
            )
        if sha256_file(path) != digest:
            raise EngineFormatError(
                f"{path} does not match {manifest_path}: its sha256 checksum differs (corrupt or edited)"
            )
