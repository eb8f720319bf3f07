"""Generate the Python protobuf and gRPC modules: python -m protos.generate (from anywhere).

The include root is the repository root, so generated imports read `from protos.llm.v1 import llm_pb2`
without any rewriting.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "protos").rglob("*.proto"))


def main() -> int:
    args = ["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={ROOT}", f"--pyi_out={ROOT}", f"--grpc_python_out={ROOT}"]
    code = protoc.main([*args, *PROTOS])
    if code == 0:
        print(f"generated Python modules for {', '.join(PROTOS)}")
    return code


if __name__ == "__main__":
    sys.exit(main())
