"""The engine-build half of the TensorRT-LLM test double: from_hugging_face, build, Engine.save, Mapping.

A "TensorRT-LLM engine" built by the double is our own native engine, built from the same Hugging Face
export with the same limits, so the double's Executor generates real tokens from the real weights. Its
rank{r}.engine file says so ("test double") and points at that native engine.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tests.trtllm_double.surface import RECORDER, SurfaceObject

DOUBLE_MARK = "tensorrt_llm test double: not a TensorRT engine"
CACHE = Path(tempfile.mkdtemp(prefix="trtllm-double-"))


class MappingDouble(SurfaceObject):
    """tensorrt_llm.Mapping (not in the JSON: tensorrt_llm/mapping.py): its checks, none of its MPI topology."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.tp_size * self.pp_size * self.cp_size != self.world_size:
            raise ValueError(f"world_size {self.world_size} != tp_size * pp_size * cp_size")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside [0, {self.world_size})")

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)


class LLaMAForCausalLMDouble(SurfaceObject):
    """models.LLaMAForCausalLM: only from_hugging_face, which copies the checkpoint (the caller deletes it)."""

    POPPED = ("load_by_shard", "load_model_on_cpu", "quant_ckpt_path", "use_autoawq")

    @classmethod
    def from_hugging_face(cls, hf_model_or_dir: Any, dtype: str = "auto", mapping: Any = None,
                          quant_config: Any = None, **kwargs: Any) -> LLaMAForCausalLMDouble:  # fmt: skip
        unknown = set(kwargs) - set(cls.POPPED)
        if unknown:
            raise TypeError(f"from_hugging_face() got unexpected keyword arguments {sorted(unknown)}")
        passed = ["hf_model_or_dir", *(n for n, v in (("dtype", dtype), ("mapping", mapping),
                  ("quant_config", quant_config)) if v is not None), *kwargs]  # fmt: skip
        RECORDER.call("tensorrt_llm.models.LLaMAForCausalLM.from_hugging_face", tuple(sorted(passed)))
        src = Path(hf_model_or_dir)
        copy = Path(tempfile.mkdtemp(prefix="hf-", dir=CACHE))
        shutil.copytree(src, copy, dirs_exist_ok=True)
        model = cls._make(hf_dir=copy, dtype=dtype, mapping=mapping, quant_config=quant_config)
        object.__setattr__(model, "config", model)  # the real one has model.config.dtype / .mapping
        return model


class EngineDouble(SurfaceObject):
    """builder.Engine: save() writes TensorRT-LLM's file names; the engine inside is a native one."""

    def save(self, engine_dir: str) -> None:
        RECORDER.call("tensorrt_llm.builder.Engine.save", ("engine_dir",))
        out = Path(engine_dir)
        out.mkdir(parents=True, exist_ok=True)
        model, build_config = self.config["model"], self.config["build_config"]
        mapping = model.mapping
        rank = mapping.rank if mapping is not None else 0
        native = out / f".double-native-rank{rank}"
        from build_engine.builder import build as native_build

        plugins = build_config.plugin_config
        limits = {"max_batch_size": build_config.max_batch_size, "max_num_tokens": build_config.max_num_tokens,
                  "max_seq_len": build_config.max_seq_len, "kv_block_size": plugins.tokens_per_block}  # fmt: skip
        native_build(str(model.hf_dir), native, limits, force=True, progress=False)
        if rank == 0:
            doc = {
                "version": "1.2.1",
                "pretrained_config": {
                    "architecture": "LlamaForCausalLM",
                    **_arch(Path(model.hf_dir)),
                    "dtype": model.dtype,
                    "mapping": {k: getattr(mapping, k, 1) for k in ("world_size", "tp_size", "pp_size")},
                    "quantization": {"quant_algo": _algo(model.quant_config)},
                },
                "build_config": {
                    "max_batch_size": build_config.max_batch_size,
                    "max_input_len": build_config.max_input_len,
                    "max_seq_len": build_config.max_seq_len,
                    "max_num_tokens": build_config.max_num_tokens,
                    "kv_cache_type": "PAGED",
                    "plugin_config": {k: getattr(plugins, k) for k in ("tokens_per_block", "gpt_attention_plugin")},
                },
            }
            (out / "config.json").write_text(json.dumps(doc, indent=2, sort_keys=True))
        (out / f"rank{rank}.engine").write_text(json.dumps({"test_double": DOUBLE_MARK, "native": native.name}))


def _arch(hf_dir: Path) -> dict[str, int]:
    """The architecture fields TensorRT-LLM's PretrainedConfig writes into config.json, from the HF config."""
    hf = json.loads((hf_dir / "config.json").read_text())
    names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads")  # fmt: skip
    head_size = hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    return {**{k: hf[k] for k in names}, "head_size": head_size}


def _algo(quant_config: Any) -> str | None:
    algo = getattr(quant_config, "quant_algo", None)
    return None if algo is None else algo.name


def build_double(model: LLaMAForCausalLMDouble, build_config: Any) -> EngineDouble:
    """tensorrt_llm.build(model, build_config) -> Engine."""
    RECORDER.call("tensorrt_llm.build", ("build_config", "model"))
    if type(build_config).__name__ != "BuildConfig":
        raise TypeError("build() takes a BuildConfig")
    return EngineDouble._make(config={"model": model, "build_config": build_config})
