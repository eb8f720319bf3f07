"""The tensorrt_llm model's (and the ensemble's) guided-decoding inputs -> our Constraint (a pure function).

The 1.2-era config.pbtxt of both models declares `guided_decoding_guide_type` and `guided_decoding_guide`, each
TYPE_STRING, dims [1], optional (TensorRT-LLM triton_backend/all_models/inflight_batcher_llm/{tensorrt_llm,
ensemble}/config.pbtxt; the ensemble passes both to tensorrt_llm unchanged). TensorRT-LLM's C++ backend
(inflight_batcher_llm/src/utils.cc, getGuidedDecodingParamsFromTensors) maps the guide type "json",
"json_schema", "regex" and "ebnf_grammar" onto GuidedDecodingParams.GuideType; we take "structural_tag" too
(GuideType.STRUCTURAL_TAG; the stored utils.cc does not map it). Onto our kinds: json -> json_object,
json_schema -> json_schema, regex -> regex, ebnf_grammar -> gbnf (XGrammar's GBNF), structural_tag ->
structural_tag.

Stricter than the C++ backend, which passes what it cannot map silently as no guided decoding: an unknown guide
type, a guide without a guide type, a missing or empty guide where one is needed, a guide with type json (which
takes none), and a json_schema or structural_tag guide that is not JSON are INVALID_ARGUMENT naming the input.
"""

from __future__ import annotations

import json

from service.errors import InvalidRequest
from service.request import Constraint

GUIDE_TYPE, GUIDE = "guided_decoding_guide_type", "guided_decoding_guide"
# the guide type's value -> our constraint kind
GUIDE_KINDS = {
    "json": "json_object",
    "json_schema": "json_schema",
    "regex": "regex",
    "ebnf_grammar": "gbnf",
    "structural_tag": "structural_tag",
}
_JSON_GUIDES = ("json_schema", "structural_tag")


def guided_constraint(guide_type: str | None, guide: str | None) -> Constraint | None:
    """The Constraint of a request's two inputs (None when both are absent)."""
    if guide_type is None:
        if guide is not None:
            raise InvalidRequest(f"input '{GUIDE}' needs '{GUIDE_TYPE}' (one of {', '.join(GUIDE_KINDS)})")
        return None
    kind = GUIDE_KINDS.get(guide_type)
    if kind is None:
        raise InvalidRequest(f"input '{GUIDE_TYPE}' must be one of {', '.join(GUIDE_KINDS)}, got {guide_type!r}")
    if kind == "json_object":
        if guide:
            raise InvalidRequest(
                f"input '{GUIDE}' is not used with {GUIDE_TYPE} 'json' (any JSON value); send 'json_schema' for a schema"
            )
        return Constraint("json_object")
    if not guide:
        raise InvalidRequest(f"input '{GUIDE}' is required with {GUIDE_TYPE} {guide_type!r}")
    if guide_type in _JSON_GUIDES:
        try:
            json.loads(guide)
        except ValueError as exc:
            raise InvalidRequest(f"input '{GUIDE}' is not valid JSON ({GUIDE_TYPE} {guide_type!r}): {exc}") from None
    try:
        return Constraint(kind, guide)
    except InvalidRequest as exc:
        raise InvalidRequest(f"input '{GUIDE}': {exc}") from None
