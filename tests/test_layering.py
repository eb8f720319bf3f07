"""The layering rules of docs (ARCHITECTURE): the scheduler side imports no numpy and no grpc; the engine core
imports no generated protobuf code; tritonclient is imported only by the Triton front door, backend and
repository generator, lazily: the native path never loads it."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _loaded_after(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return set(out.stdout.split())


@pytest.mark.parametrize(
    "module",
    ["service.engine.scheduler", "service.engine.kv_cache_manager", "service.engine.block_pool", "service.request"],
)
def test_scheduling_side_is_pure_python(module: str) -> None:
    loaded = _loaded_after(module)
    assert not {m for m in loaded if m.split(".")[0] in ("numpy", "grpc", "protos")}


@pytest.mark.parametrize(
    "module", ["service.engine.core", "service.engine.async_engine", "service.engine.runners.numpy_runner"]
)
def test_engine_does_not_import_protobuf_or_grpc(module: str) -> None:
    loaded = _loaded_after(module)
    assert not {m for m in loaded if m.split(".")[0] in ("grpc", "protos", "google")}


@pytest.mark.parametrize(
    "module", ["service.__main__", "service.api.server", "service.backends", "service.backends.native", "build_engine"]
)
def test_native_path_does_not_import_tritonclient(module: str) -> None:
    assert not {m for m in _loaded_after(module) if m.split(".")[0] in ("tritonclient", "tritongrpcclient")}


def test_triton_model_tables_are_a_leaf() -> None:
    loaded = _loaded_after("build_engine.triton_models.tables")
    assert not {m for m in loaded if m.split(".")[0] in ("tritonclient", "grpc", "numpy")}
