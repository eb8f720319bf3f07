"""Print the layer picture of the code, drawn from its imports, as a Mermaid flowchart:

    python scripts/layers.py            # the picture (docs/architecture.md holds it between its layers markers)
    python scripts/layers.py --check    # exit 1 if docs/architecture.md's copy differs from what the code says

Every module of protos/, service/, build_engine/ and clients/ is put in its room (ROOMS: the longest prefix wins);
an arrow A --> B means some module of room A imports one of room B (at the top or inside a function: a lazy
import is a dependency too). Text, sorted: the same code always prints the same picture.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("protos", "service", "build_engine", "clients")
START, END = "<!-- layers:start -->", "<!-- layers:end -->"

# module prefix -> room (id, label); a module's room is its longest matching prefix
ROOMS = {
    "protos": ("protos", "protos: llm.v1"),
    "service.__main__": ("cli", "service.__main__, service.offline: the commands"),
    "service.offline": ("cli", "service.__main__, service.offline: the commands"),
    "service.api.server": ("server", "service/api/server: the gRPC and HTTP servers, composing the doors"),
    "service.api.llm": ("llm_door", "service/api/llm: the llm.v1 door"),
    "service.api": ("edge", "service/api: the edge, validation, status, auth, health, metrics"),
    "service.api.triton": ("triton_door", "service/api/triton: the KServe v2 door, gRPC and HTTP/REST"),
    "service.api.worker": ("worker_door", "service/api/worker: the trtllm.TrtllmService door (smg-grpc-proto)"),
    "service.backends": ("backends", "service/backends: the Backend seam, runtime, native, trtllm, triton"),
    "service.engine": ("engine", "service/engine: EngineCore, scheduler, KV cache, sampler"),
    "service.engine.runners": ("runners", "service/engine/runners: the model runner"),
    "service.engine.kernels": ("kernels", "service/engine/kernels: the compiled ops, their fallbacks, the choice"),
    "service": (
        "leaves",
        "service leaves: request, config, errors, limits, stops, tokenizer, textstream, telemetry, kv_events",
    ),
    "build_engine": ("build", "build_engine: the engine directory"),
    "build_engine.triton_models": ("triton_models", "build_engine/triton_models: Triton model tables"),
    "clients": ("clients", "clients: stream, health, load tester, stress"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def room(module: str) -> tuple[str, str] | None:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        found = ROOMS.get(".".join(parts[:n]))
        if found is not None:
            return found
    return None


def imports(path: Path) -> set[str]:
    """The absolute modules a file imports (of our packages)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {m for m in found if m.split(".")[0] in PACKAGES}


def picture() -> str:
    labels: dict[str, str] = {}
    edges: set[tuple[str, str]] = set()
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            source = room(module_name(path))
            if source is None:
                continue
            labels[source[0]] = source[1]
            for target in filter(None, (room(m) for m in imports(path))):
                labels[target[0]] = target[1]
                if target[0] != source[0]:
                    edges.add((source[0], target[0]))
    lines = ["```mermaid", "flowchart TD"]
    lines += [f'    {rid}["{label}"]' for rid, label in sorted(labels.items())]
    lines += [f"    {a} --> {b}" for a, b in sorted(edges)]
    lines.append("```")
    return "\n".join(lines)


def documented() -> str:
    text = DOC.read_text()
    return text[text.index(START) + len(START) : text.index(END)].strip()


def main(argv: list[str]) -> int:
    drawn = picture()
    if "--check" in argv:
        if documented() != drawn:
            print(f"{DOC.name}'s layer picture differs from the code's imports; paste this in:\n{drawn}")
            return 1
        return 0
    print(drawn)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
