"""A test double of TensorRT-LLM 1.2.1 (`tensorrt_llm`), named as one: it stands in for what cannot run here.

Its classes and enums are generated from tests/data/trtllm_surface_1.2.json (the real 1.2-era names, keyword
arguments, defaults and enum members, read from the binding sources): a call our code makes with a name or a
keyword the real package does not have fails here as it would there. The behaviour behind the few classes our
builder and backend drive (LLaMAForCausalLM.from_hugging_face, build, Engine.save, Executor) runs our own
native engine, so tokens, streaming and timing are real. A fake `torch` with `cuda.is_available() == True`
stands in for the GPU.

    with installed() as double:   # sys.modules gets the fake packages; restored afterwards
        ...
        double.recorder.calls     # what our code called, with which keywords
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass

from tests.trtllm_double.build import EngineDouble, LLaMAForCausalLMDouble, MappingDouble, build_double
from tests.trtllm_double.executor import ExecutorDouble, GuidedDecodingParamsDouble, RequestDouble, ResponseDouble
from tests.trtllm_double.kv_events import EVENT_TYPES, KVCacheEventManagerDouble
from tests.trtllm_double.surface import (
    RECORDER,
    SURFACE,
    Recorder,
    SurfaceObject,
    entries,
    make_class,
    make_enum,
)

VERSION = "1.2.1"
BEHAVIOUR = {  # JSON classes whose behaviour the double implements
    "tensorrt_llm.bindings.executor.Executor": ExecutorDouble,
    "tensorrt_llm.bindings.executor.Request": RequestDouble,
    "tensorrt_llm.bindings.executor.Response": ResponseDouble,
    "tensorrt_llm.bindings.executor.GuidedDecodingParams": GuidedDecodingParamsDouble,
    "tensorrt_llm.bindings.executor.kv_cache.KVCacheEventManager": KVCacheEventManagerDouble,
    "tensorrt_llm.models.LLaMAForCausalLM": LLaMAForCausalLMDouble,
    "tensorrt_llm.builder.Engine": EngineDouble,
}
MODULES = (
    "tensorrt_llm",
    "tensorrt_llm.bindings",
    "tensorrt_llm.bindings.executor",
    "tensorrt_llm.bindings.executor.kv_cache",
    "tensorrt_llm.builder",
    "tensorrt_llm.llmapi",
    "tensorrt_llm.llmapi.kv_cache_type",
    "tensorrt_llm.mapping",
    "tensorrt_llm.models",
    "tensorrt_llm.models.modeling_utils",
    "tensorrt_llm.plugin",
    "tensorrt_llm.plugin.plugin",
    "tensorrt_llm.quantization",
)


class RecordingModule(types.ModuleType):
    """A fake module that records every public name looked up on it."""

    def __getattribute__(self, name: str):
        if not name.startswith("_") or name == "__version__":
            RECORDER.name(f"{types.ModuleType.__getattribute__(self, '__name__')}.{name}")
        return types.ModuleType.__getattribute__(self, name)


@dataclass
class Double:
    modules: dict[str, types.ModuleType]
    recorder: Recorder

    @property
    def executor(self) -> types.ModuleType:
        return self.modules["tensorrt_llm.bindings.executor"]


def _populate(modules: dict[str, types.ModuleType]) -> None:
    for path, module in modules.items():
        namespace: dict = {}
        for qualname, entry in sorted(entries(path).items()):
            short = qualname.rpartition(".")[2]
            if entry["kind"] == "module":  # a submodule: already a RecordingModule
                continue
            if entry["kind"] == "enum":
                obj = make_enum(qualname, entry)
            elif entry["kind"] == "function":
                obj = build_double
            else:
                obj = make_class(qualname, entry, namespace, base=BEHAVIOUR.get(qualname, SurfaceObject))
            namespace[short] = obj
            setattr(module, short, obj)
        for qualname, entry in SURFACE.items():  # nested classes: GuidedDecodingConfig.GuidedDecodingBackend, ...
            parent, _, short = qualname.rpartition(".")
            if parent.rpartition(".")[0] == path and parent.rpartition(".")[2] in namespace:
                nested = (
                    make_enum(qualname, entry) if entry["kind"] == "enum" else make_class(qualname, entry, namespace)
                )
                setattr(namespace[parent.rpartition(".")[2]], short, nested)


@contextlib.contextmanager
def installed() -> Iterator[Double]:
    """Put the fake tensorrt_llm (and a fake torch with a GPU) into sys.modules for the duration."""
    saved = {name: sys.modules.get(name) for name in (*MODULES, "torch")}
    modules = {name: RecordingModule(name) for name in MODULES}
    for name, module in modules.items():
        module.__path__ = []  # a package: submodules import
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    _populate(modules)
    root = modules["tensorrt_llm"]
    root.__version__ = VERSION
    root.Mapping = make_class("tensorrt_llm.Mapping", {}, {}, base=MappingDouble)
    modules["tensorrt_llm.mapping"].Mapping = root.Mapping
    modules["tensorrt_llm.builder"].BuildConfig = root.BuildConfig
    modules["tensorrt_llm.builder"].build = root.build
    for name, cls in EVENT_TYPES.items():  # the event classes the JSON lacks (tests/trtllm_double/kv_events.py)
        setattr(modules["tensorrt_llm.bindings.executor.kv_cache"], name, cls)
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(is_available=lambda: True)
    sys.modules.update(modules)
    sys.modules["torch"] = torch
    RECORDER.clear()
    RECORDER.seen.clear()
    try:
        yield Double(modules, RECORDER)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
