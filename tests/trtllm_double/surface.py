"""Classes and enums of the `tensorrt_llm` 1.2 surface, generated from tests/data/trtllm_surface_1.2.json.

Every generated constructor binds its arguments exactly as the JSON says (positional or keyword-only, required
or not), so a misspelt keyword (max_new_tokens for max_tokens) is a TypeError, as it is with the real
bindings; an unknown attribute on a nanobind-style class is an AttributeError; read-only properties cannot be
set. Calls and the names the code under test touches are recorded for the conformance test.
"""

from __future__ import annotations

import enum
import inspect
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

SURFACE_FILE = Path(__file__).resolve().parent.parent / "data" / "trtllm_surface_1.2.json"
SURFACE: dict[str, Any] = json.loads(SURFACE_FILE.read_text())
PARTIAL: dict[str, Any] = SURFACE["_partially_verified"]

# Names the code touches that the JSON lacks, each with the upstream file it comes from (TRTLLM_API.md 1.1;
# the digest of the 1.2-era sources). The conformance test accepts these and nothing else.
ALLOW_LIST = {
    "tensorrt_llm.__version__": "tensorrt_llm/version.py (package attribute)",
    "tensorrt_llm.Mapping": "tensorrt_llm/mapping.py (exported lazily by tensorrt_llm/__init__.py)",
    "tensorrt_llm.BuildConfig": "tensorrt_llm/builder.py (JSON _partially_verified: 1.0-era fields)",
    "tensorrt_llm.build": "tensorrt_llm/builder.py (JSON _partially_verified)",
    "tensorrt_llm.models.modeling_utils.QuantConfig": "tensorrt_llm/models/modeling_utils.py (JSON _partially_verified)",
}
# Mapping is not in the JSON: its signature from tensorrt_llm/mapping.py (tp_size/pp_size are keyword-only)
MAPPING_INIT = [
    {"name": "world_size", "default": 1, "required": False},
    {"name": "rank", "default": 0, "required": False},
    {"name": "gpus_per_node", "default": 8, "required": False},
    *({"name": n, "default": d, "required": False, "kw_only": True} for n, d in (
        ("cp_size", 1), ("cp_config", None), ("tp_size", 1), ("pp_size", 1), ("moe_cluster_size", -1),
        ("moe_tp_size", -1), ("moe_ep_size", -1), ("attn_tp_size", -1), ("attn_cp_size", -1),
        ("enable_attention_dp", False), ("enable_lm_head_tp_in_adp", False),
    )),
]  # fmt: skip


@dataclass
class Recorder:
    """What the code under test used: names looked up on the fake modules, calls and their keywords."""

    names: set[str] = field(default_factory=set)
    calls: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)  # (qualified name, keywords passed)
    objects: list[tuple[str, Any]] = field(default_factory=list)  # (qualified name, instance) built by our code
    seen: set[str] = field(default_factory=set)  # every name and keyword ever touched (clear() keeps it)

    def call(self, qualname: str, keywords: tuple[str, ...]) -> None:
        self.calls.append((qualname, keywords))
        self.seen.add(qualname)
        self.seen.update(f"{qualname}({k}=)" for k in keywords)

    def name(self, qualname: str) -> None:
        self.names.add(qualname)
        self.seen.add(qualname)

    def called(self, qualname: str) -> list[tuple[str, ...]]:
        return [kw for name, kw in self.calls if name == qualname]

    def built(self, short: str) -> list[Any]:
        """Instances of the class with this short name (e.g. "BuildConfig"), oldest first."""
        return [obj for name, obj in self.objects if name.rpartition(".")[2] == short]

    def clear(self) -> None:
        self.names.clear()
        self.calls.clear()
        self.objects.clear()


RECORDER = Recorder()
_EXPR = re.compile(r"^([A-Z]\w*)(\.(\w+))?(\(\))?$")


def signature(params: list[dict]) -> inspect.Signature:
    out = []
    for p in params:
        kind = inspect.Parameter.KEYWORD_ONLY if p.get("kw_only") else inspect.Parameter.POSITIONAL_OR_KEYWORD
        default = inspect.Parameter.empty if p["required"] else p["default"]
        out.append(inspect.Parameter(p["name"], kind, default=default))
    return inspect.Signature(out)


class SurfaceObject:
    """Base of the generated classes: attributes are the JSON's init parameters and properties."""

    _qualname: ClassVar[str] = ""
    _entry: ClassVar[dict] = {}
    _namespace: ClassVar[dict] = {}  # the module's generated classes, for defaults written as expressions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = type(self).__signature__.bind(*args, **kwargs)
        RECORDER.call(self._qualname, tuple(sorted(bound.arguments)))
        RECORDER.objects.append((self._qualname, self))
        bound.apply_defaults()
        for name, value in bound.arguments.items():
            object.__setattr__(self, name, self._resolve(value))

    @classmethod
    def _make(cls, **values: Any) -> SurfaceObject:
        """How the double itself builds objects users cannot (Result, TimingMetrics, IterationStats, ...)."""
        obj = object.__new__(cls)
        for name, value in values.items():
            object.__setattr__(obj, name, value)
        return obj

    def _resolve(self, value: Any) -> Any:
        """A default written as a Python expression ("SamplingConfig()", "BatchingType.INFLIGHT")."""
        m = _EXPR.match(value) if isinstance(value, str) else None
        if m is None or m.group(1) not in self._namespace:
            return value
        target = self._namespace[m.group(1)]
        if m.group(3):
            target = getattr(target, m.group(3))
        return target() if m.group(4) else target

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):  # the double's own state
            return object.__setattr__(self, name, value)
        entry = self._entry
        if entry.get("readonly") or name in entry.get("readonly_props", ()):
            raise AttributeError(f"{self._qualname}.{name} is read-only")
        known = {p["name"] for p in entry.get("init", [])} | set(entry.get("properties", []))
        if name not in known and not entry.get("dynamic_attr"):
            raise AttributeError(f"{self._qualname} has no attribute {name!r}")
        object.__setattr__(self, name, value)


def make_class(qualname: str, entry: dict, namespace: dict, base: type = SurfaceObject) -> type:
    init = MAPPING_INIT if qualname == "tensorrt_llm.Mapping" else entry.get("init", [])
    attrs = {
        "_qualname": qualname,
        "_entry": entry,
        "_namespace": namespace,
        "__signature__": signature(init),
        "__module__": qualname.rpartition(".")[0],
    }
    return type(qualname.rpartition(".")[2], (base,), attrs)


def make_enum(qualname: str, entry: dict) -> type[enum.Enum]:
    values = entry.get("values") or {m: i for i, m in enumerate(entry["members"])}
    return enum.Enum(qualname.rpartition(".")[2], values, module=qualname.rpartition(".")[0])


def entries(prefix: str) -> dict[str, dict]:
    """JSON entries directly under a module path (nested classes attach to their parents)."""
    found = {k: v for k, v in SURFACE.items() if not k.startswith("_") and k.rpartition(".")[0] == prefix}
    found.update({k: v for k, v in PARTIAL.items() if k.rpartition(".")[0] == prefix})
    return found


def known_names() -> set[str]:
    """Every name the real 1.2 surface has (classes, enums, their members, methods, properties, kwargs)."""
    names = set(ALLOW_LIST)
    for qualname, entry in [*SURFACE.items(), *PARTIAL.items()]:
        if qualname.startswith("_"):
            continue
        names.add(qualname)
        for p in entry.get("init", []):
            names.add(f"{qualname}({p['name']}=)")
        names.update(f"{qualname}({p}=)" for p in entry.get("params", []))  # functions
        for method, params in entry.get("methods", {}).items():
            names.add(f"{qualname}.{method}")
            names.update(f"{qualname}.{method}({p}=)" for p in params if not p.startswith("*"))
        names.update(f"{qualname}.{p}" for p in entry.get("properties", []))
        names.update(f"{qualname}.{m}" for m in entry.get("members", []))
        for method, overloads in entry.get("method_signatures", {}).items():
            for params in overloads:
                names.update(f"{qualname}.{method}({p['name']}=)" for p in params)
    names.update(f"tensorrt_llm.Mapping({p['name']}=)" for p in MAPPING_INIT)
    return names
