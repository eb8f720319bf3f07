"""The layering rules of docs (ARCHITECTURE): the scheduler side imports no numpy and no grpc; the engine core
imports no generated protobuf code; tritonclient is imported only by the Triton front door, backend and
repository generator, lazily: the native path never loads it. Imports run only up the layers: build_engine loads
nothing of service, service/engine nothing of service/api or service/backends, and no front door another one.
Each check imports in a fresh interpreter, so what another test imported does not count."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _loaded_after(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return set(out.stdout.split())


def _loaded_by_each(package: str) -> dict[str, set[str]]:
    """Every module of `package` (pkgutil, subpackages included), imported in turn in one fresh interpreter: what
    each import added to sys.modules. A module loaded as a side effect of an earlier import is that one's."""
    code = (
        "import importlib, json, pkgutil, sys\n"
        f"pkg = importlib.import_module({package!r})\n"
        "added = {pkg.__name__: sorted(sys.modules)}\n"
        "for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "    before = set(sys.modules)\n"
        "    importlib.import_module(info.name)\n"
        "    added[info.name] = sorted(set(sys.modules) - before)\n"
        "print(json.dumps(added))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"importing every module of {package} failed:\n{out.stderr}"
    return {module: set(loaded) for module, loaded in json.loads(out.stdout).items()}


def _offenders(added: dict[str, set[str]], *forbidden: str) -> dict[str, list[str]]:
    """module -> the forbidden modules (a name in `forbidden` or below it) its import loaded."""
    hits = {
        m: sorted(x for x in loaded if any(x == f or x.startswith(f + ".") for f in forbidden))
        for m, loaded in added.items()
    }
    return {m: h for m, h in hits.items() if h}


@pytest.mark.parametrize(
    "module",
    ["service.engine.scheduler", "service.engine.kv_cache_manager", "service.engine.block_pool", "service.request"],
)
def test_scheduling_side_is_pure_python(module: str) -> None:
    loaded = _loaded_after(module)
    assert not {m for m in loaded if m.split(".")[0] in ("numpy", "grpc", "protos")}


@pytest.mark.parametrize(
    "module", ["service.engine.core", "service.engine.scheduler", "service.engine.runners.numpy_runner"]
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


def test_build_engine_imports_nothing_of_service() -> None:
    """build_engine writes the engine directory (and the Triton repository); service reads it, never the reverse."""
    added = _loaded_by_each("build_engine")
    assert {
        "build_engine.triton_repo",
        "build_engine.triton_models.tables",
        "build_engine.triton_models.configs",
    } <= set(added)
    assert not _offenders(added, "service")


def test_engine_imports_no_front_door_or_backend() -> None:
    added = _loaded_by_each("service.engine")
    assert {"service.engine.core", "service.engine.scheduler"} <= set(added)
    assert not _offenders(added, "service.api", "service.backends")


def test_front_doors_import_the_edge_not_each_other() -> None:
    """The Triton door (service/api/triton/), the llm.v1 door (service/api/llm/) and the worker door
    (service/api/worker/, trtllm.TrtllmService) share service/api/edge.py and the modules around it; none imports
    another, the edge imports none, and only the Triton door's field mappings see tritonclient, only the llm.v1
    door's llm.v1's protobufs, only the worker door's smg-grpc-proto's."""
    triton = _loaded_by_each("service.api.triton")
    assert "service.api.triton.servicer" in triton and "service.api.edge" in set().union(*triton.values())
    assert not _offenders(triton, "service.api.llm", "service.api.server", "protos")
    llm = _loaded_by_each("service.api.llm")
    assert "service.api.llm.servicer" in llm and "service.api.edge" in set().union(*llm.values())
    assert not _offenders(llm, "service.api.triton", "service.api.worker", "service.api.server", "tritonclient")
    assert not _offenders(llm, "smg_grpc_proto")
    assert not _offenders(triton, "service.api.worker", "smg_grpc_proto")
    worker = _loaded_by_each("service.api.worker")
    assert "service.api.worker.servicer" in worker and "service.api.edge" in set().union(*worker.values())
    assert not _offenders(worker, "service.api.llm", "service.api.triton", "service.api.server", "protos")
    assert not _offenders(worker, "tritonclient")
    edge = _loaded_after("service.api.edge")
    doors = ("service.api.llm", "service.api.triton", "service.api.worker", "protos", "tritonclient", "smg_grpc_proto")
    assert not {m for m in edge if m.startswith(doors)}
