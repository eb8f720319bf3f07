"""Which kernels run: the C extension, numba or numpy, chosen once per process (at import) in this module only.

    C extension (csrc/, built by setup.py)   norms, RoPE, SiLU x up, KV writes, prefill and decode attention,
                                             the quantized matmuls (AVX-512 or AVX2/FMA/F16C, chosen by CPUID at
                                             import, else its portable C path)
    numba (numba_kernels.py)                 the quantized matmuls and decode attention where the extension is
                                             missing, and the matmuls where the CPU lacks AVX2 (the portable C
                                             matmul is ~8x slower than numba there, docs/kernels.md)
    numpy                                    everything else: the named ops' own fallbacks (ops.py, attention.py)

Three environment variables, read here and nowhere else:
    LLM_QUANT_KERNELS=numba|numpy   skip the C extension (the fallbacks' tests); numpy also keeps numba off the
                                    quantized matmuls (dequantize + BLAS), decode attention still uses numba
    QUANT_KERNELS_ISA=avx512|avx2|generic   run the extension's kernels for that ISA instead of the CPU's best
                                    (an ISA the CPU lacks is an error at import); generic: the portable C path
    QUANT_KERNELS_GENERIC=1         the same as QUANT_KERNELS_ISA=generic
Every SIMD path computes each matmul output with the same sequence of fp32 operations (csrc/matmul.c), so AVX-512
and AVX2 give bitwise the same tokens; the portable C path sums in another order.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

FORCED = os.environ.get("LLM_QUANT_KERNELS", "")
ISA = (
    "generic"
    if os.environ.get("QUANT_KERNELS_GENERIC", "")[:1] not in ("", "0")
    else os.environ.get("QUANT_KERNELS_ISA", "")
)
GENERIC = ISA == "generic"


@dataclass(frozen=True, slots=True)
class Backend:
    """The kernels this process runs (BACKEND below); every module of the package reads its choice from here."""

    ext: ModuleType | None  # the compiled extension, service.engine.kernels._kernels; None: not built or skipped
    numba: ModuleType | None  # service.engine.kernels.numba_kernels; None where numba does not import
    matmul: str  # the quantized matmuls: "c", or matmul_fallback
    matmul_fallback: str  # the matmuls without the extension: "numba", or "numpy" (dequantize + BLAS)
    decode_attention: str  # paged decode attention: "c", "numba" or "numpy" (gather + causal attention)

    @property
    def name(self) -> str:
        """The matmul kernels in use: 'c-avx512', 'c-avx2', 'c-generic', 'numba' or 'numpy' (the Docker build
        prints it; the benchmarks report it)."""
        return "c-" + self.ext.isa() if self.matmul == "c" else self.matmul


def _extension() -> ModuleType | None:
    if FORCED in ("numba", "numpy"):
        return None
    try:
        from service.engine.kernels import _kernels  # built by setup.py (pip install -e ., build_ext --inplace)
    except ImportError:  # pragma: no cover - only where the extension was not built (no compiler)
        stale = sorted(Path(__file__).parent.parent.glob("quant/_kernels*.so"))
        if stale:  # the extension's old place: a checkout updated without rebuilding
            logger.warning("%s is a stale build; rebuild: python setup.py build_ext --inplace", stale[0])
        return None
    if ISA:
        _kernels.force_isa(ISA)  # ValueError naming the ISA where the CPU lacks it
    return _kernels


def _numba() -> ModuleType | None:
    try:
        from service.engine.kernels import numba_kernels
    except ImportError:  # pragma: no cover - exercised only where numba is missing
        return None
    return numba_kernels


def _choose() -> Backend:
    ext, nb = _extension(), _numba()
    fallback = "numba" if nb is not None and FORCED != "numpy" else "numpy"
    c_matmul = ext is not None and (ext.isa() != "generic" or GENERIC or fallback == "numpy")
    decode = "c" if ext is not None else "numba" if nb is not None else "numpy"
    return Backend(ext, nb, "c" if c_matmul else fallback, fallback, decode)


BACKEND = _choose()
