#!/bin/sh
# Entrypoint of docker/Dockerfile.trtllm: the image's start-up smoke test, then the command.
#
# TensorRT-LLM is imported here, when the container starts (docker run --gpus ...: the GPU and its driver are
# there), never during `docker build`, where neither exists and the import can fail for reasons that say nothing
# about the image. One line on success; a failed import exits 2 before the command runs. LLM_SKIP_SMOKE_TEST=1
# skips it (it costs one more import of TensorRT-LLM per start).
set -e
if [ "${LLM_SKIP_SMOKE_TEST:-0}" != "1" ]; then
    python3 - <<'PY' || exit 2
import sys

try:
    import numpy
    import tensorrt_llm
    import tensorrt_llm.bindings.executor  # noqa: F401  (the Executor API the trtllm backend drives)
    import service.backends.trtllm  # noqa: F401
except Exception as exc:  # ImportError, or a CUDA/driver error raised while loading
    sys.exit(f"smoke test: TensorRT-LLM cannot be imported in this container ({type(exc).__name__}: {exc}); "
             "run it with --gpus all on a machine with an NVIDIA driver (docs/gpu.md)")
if not tensorrt_llm.__version__.startswith("1.2"):
    sys.exit(f"smoke test: TensorRT-LLM {tensorrt_llm.__version__} in this image; the service is written for 1.2.1")
print(f"smoke test: TensorRT-LLM {tensorrt_llm.__version__}, numpy {numpy.__version__}", file=sys.stderr)
PY
fi
exec "$@"
