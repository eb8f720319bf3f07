"""Backends behind the service: native (our engine), trtllm (TensorRT-LLM Executor), triton (a Triton server).

TensorRT-LLM and tritonclient are imported only inside their backends, so the native path never needs them.
"""

from __future__ import annotations

from build_engine.spec import engine_backend
from build_engine.verify import verify_engine
from service.backends.base import Backend
from service.config import BackendConfig


def resolve(cfg: BackendConfig) -> str:
    """The backend to run: the flag's, or (auto) the one the engine directory was built for."""
    return engine_backend(cfg.engine_dir) if cfg.backend == "auto" else cfg.backend


def preflight(cfg: BackendConfig) -> None:
    """Fail fast, before any port is bound, with one line: the backend's dependencies import (BackendLoadError),
    then the engine directory is intact and consistent (EngineFormatError; build_engine/verify.py)."""
    name = resolve(cfg)
    _check_dependencies(cfg, name)
    # NOTE: here, not in the loading thread: a bad engine then exits 2 before anything is bound or logged as
    # listening, and costs one file read (SmolLM2: 97 MB, about 70 ms), which warms the page cache for the load
    verify_engine(cfg.engine_dir, checksums=cfg.verify_checksums)


def _check_dependencies(cfg: BackendConfig, name: str) -> None:
    if name != "native" and cfg.native.speculative.enabled:
        from service.errors import BackendLoadError

        raise BackendLoadError(
            f"--speculative-method {cfg.native.speculative.method} runs on the native backend only; the {name} "
            "backend does not speculate (docs/gpu.md)"
        )
    if name == "trtllm":
        from service.backends.trtllm import import_executor

        import_executor()
    elif name == "triton":
        from service.errors import BackendLoadError

        if not cfg.triton.url:
            raise BackendLoadError("the triton backend needs --triton-url HOST:PORT (a Triton server's gRPC endpoint)")
        try:
            import tritonclient.grpc  # noqa: F401
        except ImportError as exc:
            raise BackendLoadError(f"the triton backend needs tritonclient[grpc] ({exc})") from None


def load_backend(cfg: BackendConfig) -> Backend:
    """Load the model (slow: call it in a worker thread). Raises ValueError/OSError with one clear line."""
    name = resolve(cfg)
    if name == "native":
        from service.backends.native import NativeBackend

        return NativeBackend.load(cfg)
    if name == "trtllm":
        from service.backends.trtllm import TrtllmBackend

        return TrtllmBackend(cfg)
    if name == "triton":
        from service.backends.triton import TritonBackend

        return TritonBackend(cfg)
    raise ValueError(f"unknown backend {name!r}")
