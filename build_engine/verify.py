"""Check an engine directory before it is served: a damaged or inconsistent engine fails start-up with one line,
instead of serving garbage (flipped weight bytes) or failing requests later (a vocab_size the weights lack).

verify_engine(engine_dir, checksums) runs, in this order:
  1. checksums (checksums=False skips them: `--skip-verify`): the size and sha256 of every file manifest.json
     lists (hashlib, 1 MiB reads: about 65 ms for SmolLM2's 97 MB of weights once they are in the page cache);
  2. structure, always (headers and small files: about 1 ms, plus parsing tokenizer.json: 130 ms for SmolLM2's):
     - config.json parses (a TensorRT-LLM engine: the manifest's copy of it);
     - native engines: model.safetensors' header holds exactly the tensors the runner reads, each with the shape
       config.json implies (embed rows == vocab_size, hidden size, num_hidden_layers layers, heads, intermediate
       size), packed ones in build_engine/packing.py's layout, and every byte range inside the file;
     - TensorRT-LLM engines: a rank file per GPU, and TensorRT-LLM's config.json agrees with ours on the
       architecture wherever it states it;
     - tokenizer.json loads and has no token id >= vocab_size, tokenizer_config.json is a JSON object,
       chat_template.jinja parses; the config's BOS/EOS/pad ids are < vocab_size.
Every problem is an EngineFormatError whose message names the file and the problem, on one line.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import tokenizers
from jinja2 import TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from build_engine import spec
from build_engine.packing import CHUNK_BYTES, QK, TILE_ROWS
from build_engine.spec import EngineConfig, EngineFormatError, ModelArch, load_engine_config
from build_engine.tensor_io import SafetensorsFile, TensorFileError

logger = logging.getLogger(__name__)

Dims = tuple[tuple[str, int], ...]  # a tensor's shape, each dimension with the config.json field it comes from
NORMS = ("attn_norm", "ffn_norm")  # [hidden] gains: only packed engines keep them (fp32 ones fold them in)
LAYER = re.compile(r"layers\.(\d+)\.")
# TensorRT-LLM's config.json "pretrained_config" field -> ours (ModelArch)
TRTLLM_ARCH = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads",
    "head_size": "head_dim",
}


def verify_engine(engine_dir: str | Path, checksums: bool = True) -> EngineConfig:
    """The engine's config, once its files match the manifest (unless checksums=False) and each other."""
    engine_dir = Path(engine_dir)
    start = time.perf_counter()
    config = load_engine_config(engine_dir, verify=checksums)
    if config.backend == "native":
        check_weights(engine_dir, config.arch)
    elif config.backend == "trtllm":
        check_trtllm(engine_dir, config.arch)
    else:
        raise EngineFormatError(f"{engine_dir} is an engine for backend {config.backend!r}, unknown to this code")
    check_token_ids(config)
    check_tokenizer(engine_dir, config.arch.vocab_size)
    check_chat_template(engine_dir)
    logger.info(
        "engine %s verified in %.2f s (%s)",
        engine_dir,
        time.perf_counter() - start,
        "checksums and structure" if checksums else "structure only: checksums skipped",
    )
    return config


# ---- native weights ---------------------------------------------------------------------------------------------
def runner_shapes(arch: ModelArch) -> dict[str, Dims]:
    """Every tensor the native runner reads, with its [out, in] shape (build_engine/convert.py's layout)."""
    v, d = ("vocab_size", arch.vocab_size), ("hidden_size", arch.hidden_size)
    f = ("intermediate_size", arch.intermediate_size)
    f2 = ("2 x intermediate_size", 2 * arch.intermediate_size)
    q = ("num_attention_heads x head_dim", arch.q_size)
    qkv = ("(num_attention_heads + 2 x num_key_value_heads) x head_dim", arch.q_size + 2 * arch.kv_size)
    shapes: dict[str, Dims] = {"embed": (v, d), "final_norm": (d,)}
    if not arch.tie_word_embeddings:
        shapes["lm_head"] = (v, d)
    if arch.rope_freq_factors:
        shapes["rope_freq_factors"] = (("head_dim / 2", arch.head_dim // 2),)
    for i in range(arch.num_hidden_layers):
        p = f"layers.{i}."
        shapes |= {p + "qkv": (qkv, d), p + "o": (d, q), p + "gate_up": (f2, d), p + "down": (d, f)}
    return shapes


def check_weights(engine_dir: Path, arch: ModelArch) -> None:
    """model.safetensors' header against config.json; no tensor data is read."""
    path = engine_dir / spec.WEIGHTS_FILE
    if not path.is_file():
        raise EngineFormatError(f"{path} is missing")
    try:
        w = SafetensorsFile(path)
        w.check_layout()
    except TensorFileError as exc:
        raise EngineFormatError(str(exc)) from None
    packed = _packed(w)
    _check_layer_count(w, arch)
    expected = runner_shapes(arch)
    for name, dims in expected.items():
        if name not in w:
            raise EngineFormatError(f"{path} has no tensor {name}, which {spec.CONFIG_FILE} implies")
        _check_tensor(w, name, dims, packed.get(name))
    norm = (("hidden_size", arch.hidden_size),)
    for name in w.keys():
        if name in expected:
            continue
        if name.rpartition(".")[2] not in NORMS or not LAYER.match(name):
            raise EngineFormatError(
                f"{path} holds tensor {name}, which {spec.CONFIG_FILE} does not describe (another model's weights?)"
            )
        _check_tensor(w, name, norm, packed.get(name))
    stray = sorted(set(packed) - set(w.keys()))
    if stray:
        raise EngineFormatError(f'{path}: its "packed" metadata names tensors it does not hold ({stray[0]}, ...)')


def _packed(w: SafetensorsFile) -> dict[str, dict]:
    """The file's "packed" metadata: tensor name -> {kind, rows, cols, source} (q_scale_folded dropped)."""
    try:
        packed = json.loads(w.metadata.get("packed", "{}"))
    except json.JSONDecodeError as exc:
        raise EngineFormatError(f'{w.path}: its "packed" metadata is not JSON: {exc}') from None
    if not isinstance(packed, dict):
        raise EngineFormatError(f'{w.path}: its "packed" metadata is not a JSON object')
    packed.pop("q_scale_folded", None)
    return packed


def _check_layer_count(w: SafetensorsFile, arch: ModelArch) -> None:
    layers = {int(m.group(1)) for name in w.keys() if (m := LAYER.match(name))}
    if layers != set(range(arch.num_hidden_layers)):
        held = f"layers {min(layers)}..{max(layers)}" if layers else "no layer"
        raise EngineFormatError(
            f"{w.path} holds {len(layers)} layers ({held}), but {spec.CONFIG_FILE} says num_hidden_layers "
            f"{arch.num_hidden_layers}"
        )


def _check_tensor(w: SafetensorsFile, name: str, dims: Dims, meta: dict | None) -> None:
    fields, want = [f for f, _ in dims], [n for _, n in dims]
    if meta is None:
        got, dtype = list(w.shape(name)), w.dtype(name)
        if dtype != "F32":
            raise EngineFormatError(f"{w.path}: tensor {name} is {dtype}, the runner reads F32 (or packed U8)")
    else:
        got = _packed_shape(w, name, meta)
    if got != want:
        raise EngineFormatError(
            f"{w.path}: tensor {name} is {got}, but {spec.CONFIG_FILE}'s [{', '.join(fields)}] is {want}"
        )


def _packed_shape(w: SafetensorsFile, name: str, meta: dict) -> list[int]:
    """The [rows, cols] a packed tensor's metadata declares, once its stored array has that layout."""
    try:
        kind, rows, cols = meta["kind"], int(meta["rows"]), int(meta["cols"])
    except (KeyError, TypeError, ValueError):
        raise EngineFormatError(f'{w.path}: the "packed" metadata of {name} lacks kind, rows or cols') from None
    if kind not in CHUNK_BYTES or cols % QK:
        raise EngineFormatError(f"{w.path}: packed tensor {name} has kind {kind!r} and {cols} columns (not readable)")
    layout = [-(-rows // TILE_ROWS), cols // QK, CHUNK_BYTES[kind]]  # [tiles, blocks, chunk bytes]
    if w.dtype(name) != "U8" or list(w.shape(name)) != layout:
        raise EngineFormatError(
            f"{w.path}: packed tensor {name} is stored as {w.dtype(name)} {list(w.shape(name))}; {kind} blocks of "
            f"{rows} x {cols} need U8 {layout}"
        )
    return [rows, cols]


# ---- TensorRT-LLM engines -------------------------------------------------------------------------------------
def check_trtllm(engine_dir: Path, arch: ModelArch) -> None:
    """A rank file per GPU of the build, and TensorRT-LLM's config.json agreeing with our architecture."""
    settings = spec.read_manifest(engine_dir).get("settings") or {}
    world = int(settings.get("tp_size", 1)) * int(settings.get("pp_size", 1))
    for rank in range(world):
        if not (engine_dir / f"rank{rank}.engine").is_file():
            raise EngineFormatError(
                f"{engine_dir / f'rank{rank}.engine'} is missing (the engine is built for {world} GPUs)"
            )
    path = engine_dir / spec.CONFIG_FILE
    try:
        pretrained = json.loads(path.read_text()).get("pretrained_config") or {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
        raise EngineFormatError(f"{path} is not TensorRT-LLM's engine config: {exc}") from None
    for theirs, ours in TRTLLM_ARCH.items():
        if theirs in pretrained and pretrained[theirs] != getattr(arch, ours):
            raise EngineFormatError(
                f"{path} says {theirs} {pretrained[theirs]}, but the manifest's engine config says {ours} "
                f"{getattr(arch, ours)}"
            )


# ---- tokenizer --------------------------------------------------------------------------------------------------
def check_token_ids(config: EngineConfig) -> None:
    ids = config.tokenizer
    vocab = config.arch.vocab_size
    named = [("bos_token_id", ids.bos_token_id), ("pad_token_id", ids.pad_token_id)]
    for name, token in [*named, *(("eos_token_ids", t) for t in ids.eos_token_ids)]:
        if token is not None and not 0 <= token < vocab:
            raise EngineFormatError(f"{spec.CONFIG_FILE}: tokenizer {name} {token} is outside vocab_size {vocab}")


def check_tokenizer(engine_dir: Path, vocab_size: int) -> None:
    """tokenizer.json loads and cannot produce an id the embedding lacks; tokenizer_config.json is an object."""
    path = engine_dir / spec.TOKENIZER_FILE
    if not path.is_file():
        raise EngineFormatError(f"{path} is missing")
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # NOTE: tokenizers raises a plain Exception for any unreadable or malformed file
        raise EngineFormatError(f"{path} is not a tokenizers file: {_one_line(exc)}") from None
    top = max(tok.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= vocab_size:
        raise EngineFormatError(
            f"{path} has token id {top}, beyond {spec.CONFIG_FILE}'s vocab_size {vocab_size} (embedding rows)"
        )
    path = engine_dir / spec.TOKENIZER_CONFIG_FILE
    try:
        special = json.loads(path.read_text())
    except FileNotFoundError:
        raise EngineFormatError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EngineFormatError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(special, dict):
        raise EngineFormatError(f"{path} is not a JSON object")


def check_chat_template(engine_dir: Path) -> None:
    """chat_template.jinja (when there is one) parses in the environment service/tokenizer.py renders it in."""
    path = engine_dir / spec.CHAT_TEMPLATE_FILE
    if not path.exists():
        return
    try:
        source = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise EngineFormatError(f"{path} is not readable text: {exc}") from None
    try:
        ImmutableSandboxedEnvironment(**spec.CHAT_TEMPLATE_ENV).parse(source)
    except TemplateSyntaxError as exc:  # NOTE: str(exc) spans several lines; message and line number do not
        raise EngineFormatError(f"{path}: line {exc.lineno}: template syntax error: {exc.message}") from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
