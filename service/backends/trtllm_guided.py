"""Structured output on the TensorRT-LLM backend: our Constraint as TensorRT-LLM 1.2's guided decoding (xgrammar).

The executor gets `ExecutorConfig(guided_decoding_config=GuidedDecodingConfig(backend=XGRAMMAR, encoded_vocab=...,
tokenizer_str=..., stop_token_ids=...))` from the engine's tokenizer (build_engine/xgrammar_info.py: the same three
values Triton's C++ backend reads from its xgrammar_tokenizer_info_path file), and a constrained request
`Request(guided_decoding_params=GuidedDecodingParams(guide_type=..., guide=...))`. Every name is in
tests/data/trtllm_surface_1.2.json (bindings.executor: GuidedDecodingConfig and its GuidedDecodingBackend enum,
GuidedDecodingParams and its GuideType enum, Request's keyword-only guided_decoding_params).

Kinds (service/request.py's Constraint):
- json_object -> GuideType.JSON with no guide (GuidedDecodingParams' constructor requires a guide for every other
  type: "The guide string must be provided unless using GuideType::kJSON", executor/guidedDecodingParams.cpp);
- json_schema -> JSON_SCHEMA, regex -> REGEX, structural_tag -> STRUCTURAL_TAG, each with the text as the guide;
- gbnf -> EBNF_GRAMMAR: TensorRT-LLM's EBNF is XGrammar's GBNF dialect, passed unchanged;
- choice -> EBNF_GRAMMAR `root ::= "a" | "b" | ...`, each choice a JSON-escaped string literal (GBNF takes
  JSON's escapes: \\" \\\\ \\n \\t \\uXXXX);
- lark -> refused: xgrammar takes GBNF, not Lark (the native engine's llguidance takes Lark; TensorRT-LLM 1.2's
  C++ runtime refuses llguidance);
- any_whitespace=False on a JSON kind -> refused: GuidedDecodingParams has no whitespace setting, so xgrammar's
  own default would apply and the output would not be what was asked.
Refusals are InvalidRequest (INVALID_ARGUMENT) naming the field, before anything reaches the executor. Whether a
schema, regex or grammar compiles is xgrammar's check inside the executor: a bad one comes back as the request's
error response (unverified on a GPU: docs/gpu.md).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from build_engine.xgrammar_info import XgrammarTokenizerInfo
from service.errors import InvalidRequest
from service.request import Constraint

# our constraint kind -> TensorRT-LLM's GuidedDecodingParams.GuideType member
GUIDE_TYPES = {
    "json_object": "JSON",
    "json_schema": "JSON_SCHEMA",
    "regex": "REGEX",
    "gbnf": "EBNF_GRAMMAR",
    "choice": "EBNF_GRAMMAR",
    "structural_tag": "STRUCTURAL_TAG",
}
REFUSED = {
    "lark": "constraint kind lark: the trtllm backend's grammar engine is xgrammar (TensorRT-LLM 1.2's C++ runtime "
    "supports no other), which takes GBNF grammars (kind gbnf), not Lark",
}
JSON_KINDS = ("json_object", "json_schema")
SUPPORTED_KINDS = tuple(GUIDE_TYPES)


def choice_grammar(choices: Sequence[str]) -> str:
    """A GBNF grammar whose language is exactly these strings."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def guide(constraint: Constraint) -> tuple[str, str | None]:
    """(GuideType member name, guide text or None) for a constraint; InvalidRequest for what xgrammar cannot take
    as asked."""
    reason = REFUSED.get(constraint.kind)
    if reason is not None:
        raise InvalidRequest(reason)
    if constraint.kind in JSON_KINDS and not constraint.any_whitespace:
        raise InvalidRequest(
            "constraint.any_whitespace=false: TensorRT-LLM's guided decoding has no whitespace setting "
            "(GuidedDecodingParams takes a guide type and a guide only); the trtllm backend takes any_whitespace=true"
        )
    member = GUIDE_TYPES[constraint.kind]
    if constraint.kind == "json_object":
        return member, None
    if constraint.kind == "choice":
        return member, choice_grammar(constraint.choices)
    return member, constraint.spec


def check_constraint(constraint: Constraint | None) -> None:
    """Admission: refuse, naming the field, a constraint the trtllm backend cannot send."""
    if constraint is not None:
        guide(constraint)


def guided_decoding_params(trt: ModuleType, constraint: Constraint | None) -> Any | None:
    """bindings.executor.GuidedDecodingParams for a request's constraint (None: unconstrained)."""
    if constraint is None:
        return None
    member, text = guide(constraint)
    params = trt.GuidedDecodingParams
    return params(guide_type=getattr(params.GuideType, member), guide=text)


def guided_decoding_config(trt: ModuleType, info: XgrammarTokenizerInfo) -> Any:
    """bindings.executor.GuidedDecodingConfig on xgrammar, from the engine's tokenizer."""
    config = trt.GuidedDecodingConfig
    return config(
        backend=config.GuidedDecodingBackend.XGRAMMAR,
        encoded_vocab=list(info.encoded_vocab),
        tokenizer_str=info.tokenizer_str,
        stop_token_ids=list(info.stop_token_ids),
    )
