"""Build an engine directory (native or TensorRT-LLM) or a Hugging Face export: resolve the model input,
convert, write atomically, skip when the identical engine is already there."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from safetensors.numpy import save_file

from build_engine import spec
from build_engine.convert import engine_tensors, weight_format
from build_engine.gguf_source import load_gguf, smollm2_gguf_path
from build_engine.hf_export import export_hf
from build_engine.hf_source import load_hf_dir
from build_engine.quantize import WeightPlan
from build_engine.source import BuildError, ModelSource, check_tensors
from build_engine.spec import BACKEND_DTYPES, BuildLimits, EngineConfig, EngineFormatError, TokenizerIds
from build_engine.tiny import write_tiny_checkpoint
from build_engine.trtllm_builder import TOKENS_PER_BLOCK, TrtllmOptions, build_trtllm, preflight

logger = logging.getLogger(__name__)

NAMED_MODELS = ("smollm2-135m", "tiny-random")


@contextmanager
def resolve_model(model: str) -> Iterator[ModelSource]:
    """A ModelSource for --model (a named model, a GGUF file or an HF directory); temp files cleaned after."""
    if model == "smollm2-135m":
        yield load_gguf(smollm2_gguf_path(), "smollm2-135m")
    elif model == "tiny-random":
        with tempfile.TemporaryDirectory(prefix="tiny-random-") as tmp:
            source = load_hf_dir(write_tiny_checkpoint(tmp, seed=0), "tiny-random")
            source.info = {"kind": "tiny-random", "seed": 0}
            yield source
    else:
        path = Path(model)
        if path.is_dir():
            yield load_hf_dir(path, path.name)
        elif path.is_file():
            with open(path, "rb") as f:
                magic = f.read(4)
            if magic != b"GGUF":
                raise BuildError(f"{path} is not a GGUF file (bad magic {magic!r}) nor a checkpoint directory")
            yield load_gguf(path, path.stem)
        else:
            raise BuildError(
                f"model {model!r} not found: expected one of {', '.join(NAMED_MODELS)}, "
                "a GGUF file or a Hugging Face checkpoint directory"
            )


def _engine_config(source: ModelSource, limit_args: dict[str, Any]) -> EngineConfig:
    """Build limits from the CLI's values; an unset (None) value takes the default, max_seq_len the model's."""
    defaults = {"max_seq_len": source.arch.max_position_embeddings}
    chosen = {k: v for k, v in limit_args.items() if v is not None}
    try:
        limits = BuildLimits(**{**defaults, **chosen})
    except EngineFormatError as exc:
        raise BuildError(str(exc)) from exc
    if limits.max_seq_len > source.arch.max_position_embeddings:
        raise BuildError(
            f"--max-seq-len {limits.max_seq_len} exceeds the model's max_position_embeddings "
            f"{source.arch.max_position_embeddings}"
        )
    if not source.eos_token_ids:
        raise BuildError("the model defines no end-of-sequence token (eos_token_id)")
    ids = TokenizerIds(source.bos_token_id, source.eos_token_ids, source.pad_token_id)
    return EngineConfig(model_name=source.name, arch=source.arch, limits=limits, tokenizer=ids, source=source.info)


@dataclasses.dataclass(frozen=True, slots=True)
class BuildResult:
    config: EngineConfig
    skipped: bool  # an identical engine was already at the output: nothing was written


def _manifest(out: Path, config: EngineConfig, extra: dict[str, Any]) -> dict[str, Any]:
    files = sorted(p.name for p in out.iterdir() if p.is_file() and p.name != spec.MANIFEST_FILE)
    return {
        "backend": config.backend,
        "format": spec.FORMAT_NAME,
        "format_version": spec.FORMAT_VERSION,
        **extra,
        "files": {
            name: {"bytes": (out / name).stat().st_size, "sha256": spec.sha256_file(out / name)} for name in files
        },
    }


def _write_manifest(out: Path, config: EngineConfig, extra: dict[str, Any] | None = None) -> None:
    manifest = _manifest(out, config, extra or {})
    (out / spec.MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _identity(engine_dir: Path) -> dict[str, Any] | None:
    """What decides whether an existing engine is the one a build would write: its config (input checksum,
    limits, tokenizer ids) and the backend's own build settings."""
    manifest = spec.read_manifest(engine_dir)
    if manifest.get("backend", "native") == "native":
        return {"engine": json.loads((engine_dir / spec.CONFIG_FILE).read_text())}
    return {"engine": manifest.get("engine"), "settings": manifest.get("settings")}


def is_current(output: Path, config: EngineConfig, settings: dict[str, Any] | None = None) -> bool:
    """True when `output` holds an intact engine built from the same input with the same settings.

    Native builds are deterministic (byte-identical files); for every backend an equal identity whose files all
    match the manifest's checksums is the engine this build would write.
    """
    want = {"engine": json.loads(config.to_json())}
    if config.backend != "native":
        want["settings"] = settings
    try:
        return _identity(output) == want and spec.verify_manifest(output) is None
    except (OSError, EngineFormatError, ValueError, KeyError):
        return False


def _write_files(out: Path, source: ModelSource, config: EngineConfig, plan: WeightPlan, progress: bool) -> None:
    packed: dict = {}
    tensors = dict(engine_tensors(source, progress=progress, plan=plan, meta=packed))
    # one key: safetensors writes its metadata map in no fixed order, and identical builds must be identical bytes
    metadata = {"packed": json.dumps(packed, sort_keys=True)}
    save_file(tensors, str(out / spec.WEIGHTS_FILE), metadata=metadata)
    os.chmod(out / spec.WEIGHTS_FILE, 0o644)  # safetensors creates it owner-only
    del tensors
    (out / spec.CONFIG_FILE).write_text(config.to_json())
    _write_tokenizer(out, source)
    _write_manifest(out, config)


def _write_tokenizer(out: Path, source: ModelSource) -> None:
    (out / spec.TOKENIZER_FILE).write_text(source.tokenizer_json)
    tok_cfg = dataclasses.asdict(source.special_tokens)
    (out / spec.TOKENIZER_CONFIG_FILE).write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
    if source.chat_template:
        (out / spec.CHAT_TEMPLATE_FILE).write_text(source.chat_template)


def _write_trtllm(out: Path, source: ModelSource, config: EngineConfig, options: TrtllmOptions) -> None:
    built = build_trtllm(source, config, options, out)
    _write_tokenizer(out, source)
    extra = {"engine": json.loads(config.to_json()), "settings": dataclasses.asdict(options), "built": built}
    _write_manifest(out, config, extra)


def build(
    model: str,
    output: str | Path,
    limits: dict[str, Any] | None = None,
    force: bool = False,
    progress: bool = True,
    backend: str = "native",
    trtllm: TrtllmOptions | None = None,
    weights: WeightPlan | None = None,
) -> BuildResult:
    """Build an engine for `model` into `output` (backend native or trtllm); nothing is left behind at `output`
    on failure.

    `limits` holds BuildLimits fields (max_batch_size, max_num_tokens, max_seq_len, kv_block_size, dtype);
    missing or None ones take their defaults, max_seq_len the model's max_position_embeddings, kv_block_size
    TensorRT-LLM's 32 for a trtllm build (BuildLimits' 16 for the native engine). An engine already
    at `output` is kept when it is the one this build would write (skipped=True), refused when it differs,
    and replaced with force=True.
    """
    output = Path(output)
    if backend == "trtllm":
        preflight()  # one line and nothing written when TensorRT-LLM or the GPU is missing
        trtllm = trtllm or TrtllmOptions()
        limits = {**(limits or {}), "dtype": trtllm.dtype}
        if limits.get("kv_block_size") is None:  # TensorRT-LLM's default, not the native engine's
            limits["kv_block_size"] = TOKENS_PER_BLOCK
    elif backend != "native":
        raise BuildError(f"unknown backend {backend!r} (choose native or trtllm)")
    _check_output(output)
    with resolve_model(model) as source:
        check_tensors(source)
        plan = weights or (WeightPlan("none") if backend == "trtllm" else WeightPlan())
        config = dataclasses.replace(
            _engine_config(source, limits or {}), backend=backend,
            weight_format=weight_format(source, plan) if backend == "native" else config_weights(trtllm),
        )  # fmt: skip
        if config.limits.dtype not in BACKEND_DTYPES[backend]:
            raise BuildError(f"--dtype {config.limits.dtype} is not a {backend} dtype (choose from "
                             f"{', '.join(BACKEND_DTYPES[backend])})")  # fmt: skip
        settings = dataclasses.asdict(trtllm) if trtllm is not None else None
        if output.exists() and not force:
            if is_current(output, config, settings):
                return BuildResult(config, skipped=True)
            if not _same_input(output, config):
                raise BuildError(
                    f"output directory {output} holds something else than an engine of this model (another input, "
                    "or not an engine); use --force to replace it"
                )
            logger.info("%s holds an engine of this model with other settings, an older format, or damaged "
                        "files: rebuilding it", output)  # fmt: skip

        def write(tmp: Path) -> None:
            if backend == "trtllm":
                _write_trtllm(tmp, source, config, trtllm)
            else:
                _write_files(tmp, source, config, plan, progress)

        _atomically(output, write)
    return BuildResult(config, skipped=False)


def export(model: str, output: str | Path, dtype: str = "float32", force: bool = False) -> ModelSource:
    """Export `model` as a Hugging Face checkpoint directory (python -m build_engine --format hf)."""
    output = Path(output)
    _check_output(output)
    if output.exists() and any(output.iterdir()) and not force:
        raise BuildError(f"output directory {output} is not empty (use --force to replace it)")
    with resolve_model(model) as source:
        check_tensors(source)
        _atomically(output, lambda tmp: export_hf(source, tmp, dtype))
    return source


def config_weights(trtllm: TrtllmOptions | None) -> str:
    options = trtllm or TrtllmOptions()
    return options.dtype if options.weight_only == "none" else f"{options.weight_only} weight-only"


def _same_input(output: Path, config: EngineConfig) -> bool:
    """An engine of ours built from the same model input (same checksum), whatever its settings or format."""
    try:
        manifest = spec.read_manifest(output)
        engine = manifest.get("engine") or json.loads((output / spec.CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    return engine.get("format") == spec.FORMAT_NAME and engine.get("source") == config.source


def _check_output(output: Path) -> None:
    if output.exists() and not output.is_dir():
        raise BuildError(f"output {output} exists and is not a directory")
    output.parent.mkdir(parents=True, exist_ok=True)


def _atomically(output: Path, write) -> None:
    """Write into a temporary directory next to `output`, then swap it in; nothing is left behind on failure."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the engine is read by other users (containers)
    try:
        write(tmp)
        _replace_dir(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_dir(new: Path, target: Path) -> None:
    """Put `new` at `target`; an old `target` is moved aside first and deleted only after the swap."""
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.rename(target, old / "engine")
    os.rename(new, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
