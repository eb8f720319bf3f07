"""A Triton model repository for a TensorRT-LLM engine built by `python -m build_engine --backend trtllm`.

    python -m build_engine.triton_repo --engine engines/smollm2-trtllm --output triton_repo [--engine-path PATH]

Writes TensorRT-LLM's inflight_batcher_llm layout (1.2 era) for Triton's `*-trtllm-python-py3` container:

    ensemble/        config.pbtxt (platform "ensemble": preprocessing -> tensorrt_llm -> postprocessing), 1/
    preprocessing/   config.pbtxt, 1/model.py (ours: build_engine/triton_models/preprocessing.py)
    tensorrt_llm/    config.pbtxt (backend "tensorrtllm", decoupled, inflight_fused_batching), 1/,
                     xgrammar_tokenizer_info.json (guided decoding: build_engine/xgrammar_info.py)
    postprocessing/  config.pbtxt, 1/model.py (ours: build_engine/triton_models/postprocessing.py)

Every config.pbtxt is a ModelConfig message (tritonclient's model_config_pb2) written with protobuf's text format,
from the same tensor tables the service's own Triton front door serves (build_engine/triton_models/tables.py), so
it parses by construction. The tensorrt_llm model carries every parameter the 1.2-era C++ backend reads without
a fallback (build_engine/triton_models/backend_parameters.py, read from its source at a cited commit:
`guided_decoding_backend: xgrammar` with `xgrammar_tokenizer_info_path` naming the tokenizer-info file inside the
container, or both "" (unset) with --no-guided-decoding; `tokenizer_dir` "", which the C++ backend does not use)
and the values the backend's docs call mandatory
(backend, max batch size, decoupled mode, queue delay and size, engine path, batching strategy, the logits data
type), with the paged KV cache fraction, chunked context and scheduler policy passed in as a TrtllmRuntime
(defaults: those of build_engine/trtllm_runtime.py, which the service's trtllm backend takes too) and block reuse
(on unless --no-block-reuse). Never loaded by a real Triton here (no GPU machine): docs/triton.md says what is
checked. The Python steps are our own model.py files, not copies of the container's: they tokenize with
the engine's tokenizer exactly as the service does.

Paths inside the container: the engine directory is named by --engine-path (default: --engine as an absolute
path, i.e. mount it at the same place), and the tokenizer is read from there too; the repository itself is
mounted at --repo-path (default /triton/repo, as the printed docker command does), which the
xgrammar_tokenizer_info_path parameter names.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

from build_engine import spec
from build_engine.source import BuildError
from build_engine.spec import EngineConfig, EngineFormatError, load_engine_config
from build_engine.triton_models.backend_parameters import unset_values
from build_engine.triton_models.tables import MODELS
from build_engine.trtllm_runtime import SCHEDULER_POLICIES, TrtllmRuntime
from build_engine.xgrammar_info import TOKENIZER_INFO_FILE, tokenizer_info

# The Triton container that serves engines of TensorRT-LLM 1.2.1. NOTE: not verified here (no NGC access): the
# tensorrtllm_backend moved to 1.2.1 on 2026-04-16 (its PR #853), so 26.05 is the first monthly release that can
# carry it. Check before relying on it (docs/triton.md, "Which container").
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3"
STEPS = ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing")
EXECUTOR_WORKER = "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker"
REPO_PATH = "/triton/repo"  # where run_command mounts the repository inside the container
GUIDED_DECODING_BACKEND = "xgrammar"  # the only value the C++ backend takes (getGuidedDecodingConfigFromParams)


def tokenizer_info_path(repo_path: str) -> str:
    """The xgrammar tokenizer-info file's path inside the container."""
    return f"{repo_path.rstrip('/')}/tensorrt_llm/{TOKENIZER_INFO_FILE}"


def _engine(engine_dir: Path) -> tuple[EngineConfig, dict]:
    try:
        config = load_engine_config(engine_dir)
    except EngineFormatError as exc:
        raise BuildError(str(exc)) from None
    if config.backend != "trtllm":
        raise BuildError(
            f"{engine_dir} is a {config.backend} engine; Triton's TensorRT-LLM backend serves engines built with "
            f"python -m build_engine --backend trtllm"
        )
    for name in (spec.TOKENIZER_FILE, spec.TOKENIZER_CONFIG_FILE):
        if not (engine_dir / name).is_file():
            raise BuildError(f"{engine_dir / name} is missing: the Python steps tokenize with it")
    return config, spec.read_manifest(engine_dir).get("settings", {})


def configs(
    engine_path: str,
    config: EngineConfig,
    trtllm: TrtllmRuntime,
    prefix_caching: bool = True,
    max_batch_size: int | None = None,
    python_instances: int = 1,
    max_queue_size: int = 0,
    guided_decoding_info: str | None = None,
) -> dict:
    """The four ModelConfig messages, by model name. guided_decoding_info: the xgrammar tokenizer-info file's
    path inside the container (guided decoding on xgrammar), or None (no guided decoding)."""
    from build_engine.triton_models.configs import model_config  # tritonclient's model_config_pb2

    batch = max_batch_size or config.limits.max_batch_size
    guided = {}
    if guided_decoding_info is not None:
        guided = {
            "guided_decoding_backend": GUIDED_DECODING_BACKEND,
            "xgrammar_tokenizer_info_path": guided_decoding_info,
        }
    llm_params = {
        **unset_values(),  # read without a fallback: "" (unset) unless set below
        **guided,
        "gpt_model_type": "inflight_fused_batching",  # batching_strategy
        "gpt_model_path": engine_path,  # engine_dir
        "max_beam_width": "1",
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        "batch_scheduler_policy": trtllm.scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": str(trtllm.kv_cache_free_gpu_memory_fraction),
        "enable_kv_cache_reuse": str(prefix_caching).lower(),
        "enable_chunked_context": str(trtllm.enable_chunked_context).lower(),
        "exclude_input_in_output": "false",  # Triton's default; clients send exclude_input_in_output per request
        "cancellation_check_period_ms": "100",
        "stats_check_period_ms": "100",
        "normalize_log_probs": "true",
        "decoding_mode": "top_k_top_p",
        "executor_worker_path": EXECUTOR_WORKER,
    }
    out = {
        "ensemble": model_config(MODELS["ensemble"], batch, ensemble_policy=False),
        "preprocessing": model_config(
            MODELS["preprocessing"], batch, {"tokenizer_dir": engine_path, "add_special_tokens": "true"},
            instance_count=python_instances,
        ),
        "tensorrt_llm": model_config(MODELS["tensorrt_llm"], batch, llm_params, served_only=False),
        "postprocessing": model_config(
            MODELS["postprocessing"], batch, {"tokenizer_dir": engine_path, "skip_special_tokens": "true"},
            instance_count=python_instances,
        ),
    }  # fmt: skip
    out["tensorrt_llm"].dynamic_batching.default_queue_policy.max_queue_size = max_queue_size
    return out


def write_repository(
    engine_dir: str | Path,
    output: str | Path,
    engine_path: str | None = None,
    force: bool = False,
    trtllm: TrtllmRuntime | None = None,
    prefix_caching: bool = True,
    max_batch_size: int | None = None,
    python_instances: int = 1,
    max_queue_size: int = 0,
    guided_decoding: bool = True,
    repo_path: str = REPO_PATH,
) -> Path:
    """Write the repository (atomically: a temporary directory renamed into place). Returns its path.
    repo_path: where the repository is mounted inside the container (the tokenizer-info file's parameter)."""
    from google.protobuf import text_format

    engine_dir, output = Path(engine_dir), Path(output)
    config, _ = _engine(engine_dir)
    if output.exists() and (not output.is_dir() or any(output.iterdir())) and not force:
        raise BuildError(f"{output} exists and is not empty (--force replaces it)")
    path = engine_path or str(engine_dir.resolve())
    info_path = tokenizer_info_path(repo_path) if guided_decoding else None
    messages = configs(
        path, config, trtllm or TrtllmRuntime(), prefix_caching, max_batch_size, python_instances, max_queue_size,
        info_path,
    )  # fmt: skip
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        for name in STEPS:
            (tmp / name / "1").mkdir(parents=True)
            header = (
                f"# Written by python -m build_engine.triton_repo for {config.model_name} "
                f"(engine: {path}); TensorRT-LLM's inflight_batcher_llm layout.\n"
            )
            (tmp / name / "config.pbtxt").write_text(header + text_format.MessageToString(messages[name]))
        if guided_decoding:
            tokenizer_info(engine_dir, config.tokenizer.eos_token_ids).write(tmp / "tensorrt_llm" / TOKENIZER_INFO_FILE)
        models = resources.files("build_engine.triton_models")
        for name in ("preprocessing", "postprocessing"):
            (tmp / name / "1" / "model.py").write_text(models.joinpath(f"{name}.py").read_text())
        if output.exists():
            shutil.rmtree(output)
        tmp.rename(output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output


def run_command(output: Path, engine_dir: Path, engine_path: str, world_size: int = 1, repo: str = REPO_PATH) -> str:
    serve = (
        f"python3 /app/scripts/launch_triton_server.py --world_size {world_size} --model_repo {repo}"
        if world_size > 1
        else f"tritonserver --model-repository={repo}"
    )
    return (
        f"docker run --rm --gpus all --shm-size=2g -p 8001:8001 -v {output.resolve()}:{repo}:ro "
        f"-v {engine_dir.resolve()}:{engine_path}:ro {TRITON_IMAGE} {serve}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = TrtllmRuntime()
    p = argparse.ArgumentParser(
        prog="python -m build_engine.triton_repo",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Write a Triton model repository (ensemble, preprocessing, tensorrt_llm, postprocessing) for a "
        "TensorRT-LLM engine built by python -m build_engine --backend trtllm.",
    )
    p.add_argument("--engine", required=True, help="the TensorRT-LLM engine directory")
    p.add_argument("--output", required=True, help="the repository directory to write")
    p.add_argument(
        "--engine-path",
        help="where the engine directory is inside the Triton container (default: --engine's absolute path)",
    )
    p.add_argument("--max-batch-size", type=int, help="Triton's max_batch_size (default: the engine's)")
    p.add_argument(
        "--kv-cache-free-gpu-memory-fraction",
        type=float,
        default=defaults.kv_cache_free_gpu_memory_fraction,
        help="share of the GPU memory left after the weights that the paged KV cache takes",
    )
    p.add_argument(
        "--scheduler-policy",
        default=defaults.scheduler_policy,
        choices=SCHEDULER_POLICIES,
        help="TensorRT-LLM's batch scheduler policy",
    )
    p.add_argument("--no-block-reuse", action="store_true", help="turn KV block reuse (prefix caching) off")
    p.add_argument("--no-chunked-context", action="store_true", help="prefill long prompts in one piece")
    p.add_argument("--max-queue-size", type=int, default=0, help="Triton's queue bound for tensorrt_llm (0: none)")
    p.add_argument("--python-instances", type=int, default=1, help="instances of each Python step")
    p.add_argument(
        "--no-guided-decoding",
        action="store_true",
        help="leave guided decoding off (no xgrammar tokenizer-info file, guided_decoding_backend unset)",
    )
    p.add_argument(
        "--repo-path",
        default=REPO_PATH,
        help="where the repository is mounted inside the container (the xgrammar tokenizer-info file is there)",
    )
    p.add_argument("--force", action="store_true", help="replace a non-empty --output")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trtllm = TrtllmRuntime(
        kv_cache_free_gpu_memory_fraction=args.kv_cache_free_gpu_memory_fraction,
        scheduler_policy=args.scheduler_policy,
        enable_chunked_context=not args.no_chunked_context,
    )
    engine_dir = Path(args.engine)
    try:
        out = write_repository(
            engine_dir, args.output, args.engine_path, args.force, trtllm, not args.no_block_reuse,
            args.max_batch_size, args.python_instances, args.max_queue_size, not args.no_guided_decoding,
            args.repo_path,
        )  # fmt: skip
        _, settings = _engine(engine_dir)
    except (BuildError, OSError, ValueError) as exc:
        print(f"triton_repo: error: {exc}", file=sys.stderr)
        return 2
    world = int(settings.get("tp_size", 1)) * int(settings.get("pp_size", 1))
    path = args.engine_path or str(engine_dir.resolve())
    print(f"wrote {', '.join(STEPS)} into {out}")
    print(
        f"serve it with Triton's TensorRT-LLM container:\n  {run_command(out, engine_dir, path, world, args.repo_path)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
