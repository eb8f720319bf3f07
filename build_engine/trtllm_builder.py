"""TensorRT-LLM engine build (tensorrt-llm 1.2.1, the TensorRT-engine path; imported only here, lazily).

Flow, per rank: our Hugging Face export of the model (build_engine/hf_export.py, so GGUF input works too) ->
LLaMAForCausalLM.from_hugging_face(hf_dir, dtype, mapping=Mapping(world_size, rank, tp_size, pp_size),
quant_config=QuantConfig(W8A16 | W4A16)) -> build(model, BuildConfig(...)) -> Engine.save(dir). The engine
directory then holds TensorRT-LLM's config.json and rank*.engine, our tokenizer files, and our manifest.json
(backend, versions, build settings, checksums), so `python -m service --engine DIR` starts on it as on a
native engine. Every plugin setting whose default changed across versions is set explicitly
(../shared/docs/TRTLLM_API.md 1.3): the 0.9-era defaults were gpt_attention_plugin=float16,
tokens_per_block=128, use_paged_context_fmha=False.
"""

from __future__ import annotations

import importlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from build_engine.hf_export import export_hf
from build_engine.source import BuildError, ModelSource
from build_engine.spec import EngineConfig

TRTLLM_VERSION = "1.2.1"  # the pin: upstream removes the TensorRT-engine path after 1.3.0rc20
WEIGHT_ONLY_ALGOS = {"int8": "W8A16", "int4": "W4A16"}  # per-channel weight-only, no calibration needed
# tokens per KV block when --kv-block-size is not given: TensorRT-LLM's own default (PluginConfig.tokens_per_block
# and enable_paged_kv_cache(tokens_per_block=32), 1.2 era); the native engine keeps BuildLimits' 16
TOKENS_PER_BLOCK = 32
INSTALL_HINT = (
    f"the trtllm backend needs TensorRT-LLM {TRTLLM_VERSION} and an NVIDIA GPU: pip install --no-deps -e . inside "
    f"NVIDIA's TensorRT-LLM {TRTLLM_VERSION} container (docker/Dockerfile.trtllm), or pip install "
    f"'tensorrt-llm=={TRTLLM_VERSION}' --extra-index-url https://pypi.nvidia.com (docs/gpu.md)"
)


@dataclass(frozen=True, slots=True)
class TrtllmOptions:
    """What the TensorRT-LLM build takes beyond the shared limits (recorded in the manifest)."""

    dtype: str = "float16"  # float16 | bfloat16
    weight_only: str = "none"  # none | int8 (W8A16) | int4 (W4A16)
    max_input_len: int | None = None  # None: max_seq_len
    tp_size: int = 1
    pp_size: int = 1

    def __post_init__(self) -> None:
        if self.weight_only not in ("none", *WEIGHT_ONLY_ALGOS):
            raise BuildError(f"--weight-only {self.weight_only} is not a TensorRT-LLM choice (none, int8, int4)")
        if self.tp_size < 1 or self.pp_size < 1:
            raise BuildError("--tp-size and --pp-size must be >= 1")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size


def import_tensorrt_llm() -> ModuleType:
    """The tensorrt_llm package, or a BuildError with one line saying what is missing and how to get it."""
    try:
        trt = importlib.import_module("tensorrt_llm")
    except ImportError as exc:
        raise BuildError(f"tensorrt_llm cannot be imported ({exc}); {INSTALL_HINT}") from None
    version = getattr(trt, "__version__", "unknown")
    if not str(version).startswith("1.2"):
        raise BuildError(f"tensorrt_llm {version} is installed; this code is written for {TRTLLM_VERSION}")
    return trt


def preflight() -> None:
    """Fail fast, before any input is read or anything written: TensorRT-LLM importable and a GPU visible."""
    import_tensorrt_llm()
    require_gpu()


def require_gpu() -> None:
    try:
        torch = importlib.import_module("torch")
        ok = bool(torch.cuda.is_available())
    except ImportError:
        ok = False
    if not ok:
        raise BuildError(f"no NVIDIA GPU is visible (torch.cuda.is_available() is False); {INSTALL_HINT}")


def build_trtllm(source: ModelSource, config: EngineConfig, options: TrtllmOptions, out: Path) -> dict:
    """Build every rank's engine into `out` (an empty directory; preflight() passed); returns the settings for
    the manifest."""
    from tensorrt_llm import BuildConfig, Mapping, build
    from tensorrt_llm.llmapi.kv_cache_type import KVCacheType
    from tensorrt_llm.models import LLaMAForCausalLM
    from tensorrt_llm.models.modeling_utils import QuantConfig
    from tensorrt_llm.plugin import PluginConfig
    from tensorrt_llm.quantization import QuantAlgo

    limits = config.limits
    max_input_len = options.max_input_len or limits.max_seq_len
    if max_input_len > limits.max_seq_len:
        raise BuildError(f"--max-input-len {max_input_len} exceeds --max-seq-len {limits.max_seq_len}")
    quant = None
    if options.weight_only != "none":
        quant = QuantConfig(quant_algo=getattr(QuantAlgo, WEIGHT_ONLY_ALGOS[options.weight_only]))
    hf_dir = Path(tempfile.mkdtemp(prefix="hf-export-", dir=out.parent))
    try:
        export_hf(source, hf_dir, options.dtype)  # weights in the engine's dtype: half the bytes to read
        for rank in range(options.world_size):
            mapping = Mapping(
                world_size=options.world_size, rank=rank, tp_size=options.tp_size, pp_size=options.pp_size
            )
            model = LLaMAForCausalLM.from_hugging_face(str(hf_dir), dtype=options.dtype, mapping=mapping,
                                                       quant_config=quant)  # fmt: skip
            plugins = PluginConfig(
                gpt_attention_plugin=options.dtype,
                gemm_plugin=options.dtype,
                remove_input_padding=True,  # in-flight batching needs the packed (unpadded) layout
                context_fmha=True,
                use_paged_context_fmha=True,  # needed for KV block reuse and chunked context
                tokens_per_block=limits.kv_block_size,
            )
            build_config = BuildConfig(
                max_batch_size=limits.max_batch_size,
                max_input_len=max_input_len,
                max_seq_len=limits.max_seq_len,
                max_num_tokens=limits.max_num_tokens,
                max_beam_width=1,
                kv_cache_type=KVCacheType.PAGED,
                plugin_config=plugins,
            )
            engine = build(model, build_config)
            engine.save(str(out))
            del model, engine
    finally:
        shutil.rmtree(hf_dir, ignore_errors=True)
    return {
        "dtype": options.dtype,
        "weight_only": options.weight_only,
        "max_input_len": max_input_len,
        "tp_size": options.tp_size,
        "pp_size": options.pp_size,
        "tensorrt_llm_version": str(importlib.import_module("tensorrt_llm").__version__),
    }
